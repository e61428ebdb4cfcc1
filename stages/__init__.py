"""Built-in stage types, one module each; a new type is one module plus one line below."""

from __future__ import annotations

from pipeline.registry import StageRegistry
from stages.agent import AgentStage
from stages.audit import AuditStage
from stages.cache import CacheStage
from stages.embed import EmbedStage
from stages.generate import GenerateStage
from stages.llm import LlmStage
from stages.policy import PolicyStage
from stages.prompt import PromptStage
from stages.reply import ReplyStage
from stages.retrieve import RetrieveStage
from stages.route import RouteStage
from stages.score import ScoreStage
from stages.split import SplitStage
from stages.stream import StreamStage
from stages.subpipeline import PipelineStep
from stages.tokenize import TokenizeStage

BUILTIN_STAGES = (PolicyStage, RetrieveStage, RouteStage, PromptStage, TokenizeStage, CacheStage, GenerateStage,
                  StreamStage, ScoreStage, EmbedStage, AuditStage, LlmStage, ReplyStage,
                  PipelineStep, SplitStage, AgentStage)


def register_builtins(registry: StageRegistry) -> StageRegistry:
    """Register every built-in stage type on *registry*; returns it."""
    for cls in BUILTIN_STAGES:
        registry.register(cls)
    return registry
