"""What the pipeline page draws: its steps as boxes in layers by depth, what they need as arrows.

The layout is made here, on the server, from the pipeline's checked graph (pipeline/graph.py), and the page
writes it out as inline SVG (templates/_macros.html, ``graph_svg``): the console's Content-Security-Policy
lets no script or style in from elsewhere, and a drawing laid out before it is sent needs neither.

* A step's layer is its depth: 0 for a step that needs nothing, else one more than the deepest step it needs;
  layers run top to bottom, so steps that may run side by side are drawn side by side.
* Within a layer, steps sit by the mean place of the steps they need (fewer crossing arrows), then in file order.
* A fallback sits right of its primary, joined by a dashed arrow; it runs on its primary's needs, which the
  primary's arrows show. A loop's closing step has a dashed arrow back to the loop's first step, round the
  left of the boxes (their right is where fallbacks sit).
* An ``always`` step without ``needs:`` waits for every step before it; it is drawn with arrows from only those
  that no other of them runs after (the rest follow), so a chain that ends in ``audit`` still reads as a chain.
  Declared ``needs:`` are each drawn.
"""

from __future__ import annotations

from dataclasses import dataclass
from statistics import fmean

from pipeline.plan import LoadedPipeline

BOX_WIDTH = 150
BOX_HEIGHT = 44
_GAP_X = 28
_GAP_Y = 48
_MARGIN = 14
#: Room left of the boxes for a loop's arrow back up.
_LOOP_ROOM = 40
#: The most characters of an id or type shown in a box (the whole id is in the box's tooltip).
_MAX_LABEL = 18


@dataclass(frozen=True, slots=True)
class Box:
    """One step: its place (top-left corner) and what its box says."""

    id: str
    type: str
    x: int
    y: int
    layer: int
    #: CSS classes beyond ``node``: always, conditional (it has a when:), fallback, stream.
    kinds: tuple[str, ...]
    #: The tooltip: the whole id, its type and what it needs.
    title: str

    @property
    def label(self) -> str:
        return _short(self.id)

    @property
    def type_label(self) -> str:
        return _short(self.type)


@dataclass(frozen=True, slots=True)
class Arrow:
    """One arrow: ``needs`` (target needs source), ``fallback`` (target runs in source's place) or ``repeat``
    (source closes a loop that starts again at target)."""

    source: str
    target: str
    kind: str
    #: The SVG path's ``d``.
    path: str


@dataclass(frozen=True, slots=True)
class GraphDrawing:
    """A pipeline's graph laid out, in SVG user units."""

    width: int
    height: int
    boxes: tuple[Box, ...]
    arrows: tuple[Arrow, ...]
    box_width: int = BOX_WIDTH
    box_height: int = BOX_HEIGHT

    @property
    def summary(self) -> str:
        """The drawing in words, for screen readers (the svg's title)."""
        layers = max((box.layer for box in self.boxes), default=-1) + 1
        return (f"The graph of {len(self.boxes)} steps in {layers} layers; arrows point from a step to those that "
                "need it.")


def draw(loaded: LoadedPipeline) -> GraphDrawing | None:
    """The drawing of *loaded*'s graph (None for a pipeline loaded without one)."""
    graph = loaded.graph
    if graph is None:
        return None
    specs = {spec.id: spec for spec in loaded.spec.stages}
    fallback_of = {fallback: primary for primary, fallback in graph.fallbacks.items()}
    drawn = {step: () if step in fallback_of else
             _drawn_needs(graph.deps[step], specs[step].needs is None, graph.ancestors) for step in graph.order}
    depth: dict[str, int] = {}
    for step in graph.order:  # every step comes after what it needs
        depth[step] = 1 + max((depth[need] for need in graph.deps[step]), default=-1)
    layers = _layers(graph.ids, graph.order, depth, drawn, fallback_of, graph.fallbacks)
    widest = max(len(layer) for layer in layers) if layers else 0
    indent = _MARGIN + (_LOOP_ROOM if graph.loops else 0)
    width = indent + _MARGIN + widest * BOX_WIDTH + max(widest - 1, 0) * _GAP_X
    height = 2 * _MARGIN + len(layers) * BOX_HEIGHT + max(len(layers) - 1, 0) * _GAP_Y
    boxes: dict[str, Box] = {}
    for n, layer in enumerate(layers):
        row_width = len(layer) * BOX_WIDTH + (len(layer) - 1) * _GAP_X
        left = indent + (widest * BOX_WIDTH + (widest - 1) * _GAP_X - row_width) // 2
        for i, step in enumerate(layer):
            spec = specs[step]
            kinds = tuple(kind for kind, has in (("always", spec.always), ("conditional", spec.when is not None),
                                                 ("fallback", step in fallback_of), ("stream", spec.stream)) if has)
            needs = (f"runs in the place of {fallback_of[step]}" if step in fallback_of else
                     f"needs {', '.join(graph.deps[step])}" if graph.deps[step] else "needs nothing")
            boxes[step] = Box(step, spec.type, left + i * (BOX_WIDTH + _GAP_X), _MARGIN + n * (BOX_HEIGHT + _GAP_Y),
                              n, kinds, f"{step} ({spec.type}): {needs}")
    arrows = [Arrow(need, step, "needs", _down(boxes[need], boxes[step]))
              for step in graph.order for need in drawn[step]]
    arrows += [Arrow(primary, fallback, "fallback", _across(boxes[primary], boxes[fallback]))
               for primary, fallback in graph.fallbacks.items()]
    arrows += [Arrow(closer, body[0], "repeat", _back(boxes[closer], boxes[body[0]]))
               for closer, body in graph.loops.items()]
    return GraphDrawing(width, height, tuple(boxes[step] for step in graph.ids if step in boxes), tuple(arrows))


def _drawn_needs(deps: tuple[str, ...], implied: bool, ancestors: dict[str, frozenset[str]]) -> tuple[str, ...]:
    """The needs of a step that get an arrow: all that it declares; of those it was given (an always step's
    every earlier step), only the ones no other of them runs after."""
    if not implied or len(deps) < 2:
        return deps
    return tuple(need for need in deps if not any(need in ancestors[other] for other in deps if other != need))


def _layers(ids: tuple[str, ...], order: tuple[str, ...], depth: dict[str, int], drawn: dict[str, tuple[str, ...]],
            fallback_of: dict[str, str], fallbacks: dict[str, str]) -> list[list[str]]:
    """The steps of each layer, left to right (see the module docstring); a fallback right after its primary."""
    file_index = {step: i for i, step in enumerate(ids)}
    layers: list[list[str]] = [[] for _ in range(max(depth.values(), default=-1) + 1)]
    place: dict[str, int] = {}
    for n, layer in enumerate(layers):
        primaries = [step for step in order if depth[step] == n and step not in fallback_of]
        primaries.sort(key=lambda step: (fmean([place[need] for need in drawn[step]]) if drawn[step] else 0.0,
                                         file_index[step]))
        for step in primaries:
            layer.append(step)
            if step in fallbacks:
                layer.append(fallbacks[step])
        place.update({step: i for i, step in enumerate(layer)})
    return layers


def _down(source: Box, target: Box) -> str:
    """From the bottom of *source* to the top of *target*, an S-curve."""
    x1, y1 = source.x + BOX_WIDTH // 2, source.y + BOX_HEIGHT
    x2, y2 = target.x + BOX_WIDTH // 2, target.y
    bend = (y2 - y1) // 2
    return f"M{x1} {y1} C{x1} {y1 + bend} {x2} {y2 - bend} {x2} {y2}"


def _across(primary: Box, fallback: Box) -> str:
    """From the right side of *primary* to the left side of its *fallback*, beside it."""
    y = primary.y + BOX_HEIGHT // 2
    return f"M{primary.x + BOX_WIDTH} {y} L{fallback.x} {y}"


def _back(closer: Box, first: Box) -> str:
    """From the left side of a loop's closing step up to the left side of its first step, through the room left
    of the boxes (from low on the side to high on it, so a loop of one step is a loop too)."""
    x1, y1 = closer.x, closer.y + 2 * BOX_HEIGHT // 3
    x2, y2 = first.x, first.y + BOX_HEIGHT // 3
    return f"M{x1} {y1} C0 {y1} 0 {y2} {x2} {y2}"


def _short(text: str) -> str:
    return text if len(text) <= _MAX_LABEL else text[:_MAX_LABEL - 1] + "…"
