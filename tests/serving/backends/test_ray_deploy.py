"""``inferline deploy`` and the ``ray:`` section of a model: the Ray Serve config it writes."""

from __future__ import annotations

import warnings

import pytest
import yaml
from pydantic import ValidationError

from serving.cli.main import main
from serving.config.models import ModelSpec

SAMPLE = """\
models:
  smol:
    backend: ray
    source: models/smollm2-135m-instruct
    ray:
      autoscaling: {min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8, upscale_delay_s: 5,
                    downscale_delay_s: 60}
      ray_actor_options: {num_cpus: 2, num_gpus: 0.5}
  fixed:
    backend: ray
    source: models/smollm2-135m-instruct
    placement: least_loaded
    ray: {num_replicas: 3}
  here:
    source: models/smollm2-135m-instruct
http: {host: 0.0.0.0, port: 9000}
"""


@pytest.fixture
def config_file(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)
    path = tmp_path / "inferline.yaml"
    path.write_text(SAMPLE)
    return path


def test_deploy_writes_one_deployment_per_ray_model(config_file, tmp_path, capsys):
    out = tmp_path / "serve.yaml"
    assert main(["deploy", "--config", str(config_file), "--output", str(out)]) == 0
    assert f"wrote {out}" in capsys.readouterr().out
    config = yaml.safe_load(out.read_text())
    assert config["http_options"] == {"host": "0.0.0.0", "port": 9000}
    [app] = config["applications"]
    assert app["name"] == "inferline"
    assert app["import_path"] == "serving.ray_ingress:build_app"
    assert app["route_prefix"] == "/"
    assert app["args"] == {"config": str(config_file.resolve())}
    deployments = {d["name"]: d for d in app["deployments"]}
    assert list(deployments) == ["ingress", "engine-smol", "engine-fixed"]
    smol = deployments["engine-smol"]
    assert "num_replicas" not in smol
    assert smol["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 4, "target_ongoing_requests": 8.0,
                                          "upscale_delay_s": 5.0, "downscale_delay_s": 60.0,
                                          "look_back_period_s": 30.0}
    assert smol["ray_actor_options"] == {"num_cpus": 2.0, "num_gpus": 0.5}
    # placement: prefix (the default) is our request router, with the model's KV block size.
    assert smol["request_router_config"] == {
        "request_router_class": "serving.backends.ray_router.PrefixRouter",
        "request_router_kwargs": {"block_size": 16, "prefix_blocks": 4, "max_imbalance": 16}}
    fixed = deployments["engine-fixed"]
    assert fixed["num_replicas"] == 3
    assert "autoscaling_config" not in fixed
    assert fixed["ray_actor_options"] == {"num_cpus": 1.0, "num_gpus": 0.0}
    assert "request_router_config" not in fixed  # least_loaded: Ray Serve's own router
    assert deployments["ingress"] == {"name": "ingress", "num_replicas": 1, "max_ongoing_requests": 64,
                                      "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0}}


def test_the_written_config_is_one_ray_serve_accepts(config_file, tmp_path):
    with_ingress = config_file.read_text() + "ray_ingress: {num_replicas: 2, ray_actor_options: {num_cpus: 0.5}}\n"
    config_file.write_text(with_ingress)
    out = tmp_path / "serve.yaml"
    assert main(["deploy", "--config", str(config_file), "--output", str(out)]) == 0
    with warnings.catch_warnings():  # Ray Serve's own pydantic models use V1-style Field options
        warnings.simplefilter("ignore", DeprecationWarning)
        from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(yaml.safe_load(out.read_text()))
    deployments = {d.name: d for d in schema.applications[0].deployments}
    assert deployments["ingress"].num_replicas == 2
    assert deployments["ingress"].ray_actor_options.num_cpus == 0.5
    router = deployments["engine-smol"].request_router_config
    assert router["request_router_class"] == "serving.backends.ray_router.PrefixRouter"


def test_deploy_defaults_to_inferline_yaml_and_serve_yaml(config_file, tmp_path):
    assert main(["deploy"]) == 0
    assert (tmp_path / "serve.yaml").exists()


def test_deploy_without_ray_models_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)
    (tmp_path / "inferline.yaml").write_text("models:\n  here: {source: models/x}\n")
    assert main(["deploy"]) == 1
    err = capsys.readouterr().err
    assert "no model has backend: ray" in err
    assert "models: here" in err
    assert not (tmp_path / "serve.yaml").exists()


def test_deploy_without_a_config_says_so(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv("INFERLINE_CONFIG", raising=False)
    assert main(["deploy"]) == 1
    assert "deploy needs a server config" in capsys.readouterr().err


@pytest.mark.parametrize(("fields", "message"), [
    ({"backend": "ray"}, "a ray model needs source:"),
    ({"source": "m", "ray": {"num_replicas": 2}}, "ray: applies to backend: ray only"),
    ({"backend": "ray", "source": "m", "replicas": 2}, "set ray.num_replicas"),
    ({"backend": "ray", "source": "m", "ray": {"num_replicas": 2, "autoscaling": {}}}, "not both"),
    ({"backend": "ray", "source": "m", "ray": {"autoscaling": {"min_replicas": 3, "max_replicas": 2}}},
     "min_replicas (3) must not exceed max_replicas (2)"),
    ({"backend": "ray", "source": "m", "ray": {"num_replica": 2}}, "Extra inputs are not permitted"),
    ({"backend": "ray", "source": "m", "placement": "round_robin"}, "round_robin applies to local replicas"),
    ({"backend": "ray", "source": "m", "ray": {"autoscaling": {"look_back_period_s": 5}}},
     "look_back_period_s (5.0) must exceed metrics_interval_s (10.0, Ray default)"),
    ({"backend": "ray", "source": "m", "ray": {"autoscaling": {"look_back_period_s": 2, "metrics_interval_s": 2}}},
     "look_back_period_s (2.0) must exceed metrics_interval_s (2.0)"),
])
def test_ray_section_errors(fields, message):
    with pytest.raises(ValidationError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ModelSpec.model_validate(fields)


def test_ray_model_defaults_to_one_replica():
    from serving.backends.ray_deploy import deployment_options

    spec = ModelSpec.model_validate({"backend": "ray", "source": "m", "placement": "least_loaded"})
    assert deployment_options(spec) == {"num_replicas": 1, "max_ongoing_requests": 64,
                                        "ray_actor_options": {"num_cpus": 1.0, "num_gpus": 0.0}}


def test_a_short_metrics_interval_is_passed_to_ray():
    from serving.backends.ray_deploy import deployment_options

    spec = ModelSpec.model_validate({"backend": "ray", "source": "m", "ray": {"autoscaling": {
        "max_replicas": 2, "look_back_period_s": 2, "metrics_interval_s": 0.5}}})
    scaling = deployment_options(spec)["autoscaling_config"]
    assert scaling["metrics_interval_s"] == 0.5 and scaling["look_back_period_s"] == 2.0
