"""Config loading: file plus env overrides, errors that name the problem, no secrets in logs."""

from __future__ import annotations

import logging
import typing
from pathlib import Path

import pytest
from pydantic import BaseModel, Field, SecretStr, ValidationError

from asymptote.config import (
    Frozen,
    ListenSettings,
    NatsSettings,
    ServiceSettings,
    dump_config,
    env_overrides,
    load_config,
    log_resolved,
)
from asymptote.errors import ConfigError
from services.broker.config import BrokerConfig
from services.fitter.config import FitterConfig
from services.generator.config import GeneratorConfig
from services.learner.config import LearnerConfig
from services.local.config import StackConfig

PREFIX = "ASY_X"


class Leaf(Frozen):
    b: int = 0
    flag: bool = False
    ratio: float = 0.5


class Section(Frozen):
    a: Leaf = Leaf()
    name: str = "default"


class Demo(Frozen):
    x: Section = Section()
    rate_s: float = 1.0
    tags: list[str] = Field(default_factory=list)
    nats: NatsSettings = NatsSettings()


def write(tmp_path: Path, text: str, name: str = "config.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_file_plus_env_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "x:\n  name: from-file\n  a:\n    b: 1\n    flag: true\nrate_s: 2.5\n")
    environ = {
        "ASY_X__X__A__B": "3",  # nested, and typed by YAML: int 3
        "ASY_X__X__A__RATIO": "0.25",
        "ASY_X__TAGS": "[fast, small]",
        "ASY_X__NATS__URL": "nats://nats.asy.svc:4222",
        "ASY_XY__RATE_S": "99",  # another prefix: ignored
        "OTHER": "1",
    }
    config = load_config(Demo, path, PREFIX, environ)
    assert config.x.a == Leaf(b=3, flag=True, ratio=0.25)  # b overridden, flag kept from the file
    assert config.x.name == "from-file"
    assert config.rate_s == 2.5
    assert config.tags == ["fast", "small"]
    assert config.nats.url == "nats://nats.asy.svc:4222"
    assert config.nats.connect_timeout_s == 5.0  # untouched default


def test_env_overrides_tree() -> None:
    tree = env_overrides(
        "ASY_X", {"ASY_X__X__A__B": "3", "ASY_X__X__NAME": "n", "ASY_X__RATE_S": "1e-3", "ASY_X__": "1"}
    )
    # Scalars stay strings; pydantic converts them to the field's type.
    assert tree == {"x": {"a": {"b": "3"}, "name": "n"}, "rate_s": "1e-3"}
    assert load_config(Demo, None, PREFIX, {"ASY_X__RATE_S": "1e-3"}).rate_s == pytest.approx(1e-3)


def test_no_file_uses_defaults_and_reads_os_environ(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ASY_X__X__NAME", "from-env")
    config = load_config(Demo, None, PREFIX)
    assert config.x.name == "from-env"
    assert config.rate_s == 1.0


def test_empty_file_is_an_empty_mapping(tmp_path: Path) -> None:
    assert load_config(Demo, write(tmp_path, "\n"), PREFIX, {}) == Demo()


def test_unknown_key_in_file_is_named(tmp_path: Path) -> None:
    path = write(tmp_path, "x:\n  a:\n    bogus_knob: 1\n")
    with pytest.raises(ConfigError) as info:
        load_config(Demo, path, PREFIX, {})
    message = str(info.value)
    assert "x.a.bogus_knob" in message
    assert "Extra inputs are not permitted" in message
    assert str(path) in message


def test_unknown_key_from_env_is_named() -> None:
    with pytest.raises(ConfigError, match=r"x\.nmae: Extra inputs") as info:
        load_config(Demo, None, PREFIX, {"ASY_X__X__NMAE": "typo"})
    assert "ASY_X__" in str(info.value)


def test_bad_type_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"rate_s: Input should be a valid number"):
        load_config(Demo, write(tmp_path, "rate_s: fast\n"), PREFIX, {})
    with pytest.raises(ConfigError, match=r"x\.a\.b: Input should be a valid integer"):
        load_config(Demo, None, PREFIX, {"ASY_X__X__A__B": "2.5"})
    # A scalar where a section belongs, and a section where a scalar belongs.
    with pytest.raises(ConfigError, match=r"x\.a: Input should be a valid dictionary"):
        load_config(Demo, write(tmp_path, "x:\n  a: 3\n"), PREFIX, {})
    with pytest.raises(ConfigError, match=r"rate_s: Input should be a valid number"):
        load_config(Demo, write(tmp_path, "rate_s: 2\n"), PREFIX, {"ASY_X__RATE_S__INNER": "1"})


def test_every_invalid_field_is_reported(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(Demo, write(tmp_path, "rate_s: fast\nx:\n  a:\n    b: many\n"), PREFIX, {})
    assert "rate_s:" in str(info.value) and "x.a.b:" in str(info.value)


@pytest.mark.parametrize(("text", "kind"), [("- 1\n- 2\n", "list"), ("just a string\n", "str"), ("42\n", "int")])
def test_non_mapping_file(tmp_path: Path, text: str, kind: str) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError, match=f"must hold a mapping, got {kind}"):
        load_config(Demo, path, PREFIX, {})


def test_missing_and_unparsable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError, match=f"cannot read config file {missing}"):
        load_config(Demo, missing, PREFIX, {})
    with pytest.raises(ConfigError, match="is not valid YAML"):
        load_config(Demo, write(tmp_path, "x: [unclosed\n"), PREFIX, {})


def test_override_below_a_scalar_env_value_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"override x\.a\.b goes inside a, which is not a section"):
        env_overrides(PREFIX, {"ASY_X__X__A": "1", "ASY_X__X__A__B": "2"})


def test_configs_are_frozen() -> None:
    config = load_config(Demo, None, PREFIX, {})
    with pytest.raises(ValidationError, match="frozen"):
        config.rate_s = 3.0  # type: ignore[misc]
    with pytest.raises(ValidationError, match="frozen"):
        config.x.a.b = 3  # type: ignore[misc]


def test_password_is_not_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = write(tmp_path, "nats:\n  user: asy\n  password: hunter2-from-file\n")
    config = load_config(Demo, path, PREFIX, {"ASY_X__NATS__PASSWORD": "s3cr3t-from-env"})
    assert isinstance(config.nats.password, SecretStr)
    assert config.nats.password.get_secret_value() == "s3cr3t-from-env"
    caplog.set_level(logging.INFO, logger="asymptote.config")
    log_resolved(config, "demo")
    assert len(caplog.records) == 1
    text = caplog.text
    assert "demo config" in text and '"user": "asy"' in text
    assert '"password": "**********"' in text
    assert "s3cr3t" not in text and "hunter2" not in text
    assert "s3cr3t" not in repr(config) and "s3cr3t" not in str(config)


# --------------------------------------------------------------------------
# The real service configs
# --------------------------------------------------------------------------


def test_broker_rejects_fewer_outstanding_tasks_than_a_batch(tmp_path: Path) -> None:
    path = write(tmp_path, "batch_prompts: 8\nmax_outstanding_tasks: 4\n")
    with pytest.raises(ConfigError, match=r"max_outstanding_tasks \(4\) must be at least batch_prompts \(8\)"):
        load_config(BrokerConfig, path, "ASY_BROKER", {})
    # Equal is enough; unset derives twice the batch.
    ok = load_config(BrokerConfig, path, "ASY_BROKER", {"ASY_BROKER__MAX_OUTSTANDING_TASKS": "8"})
    assert ok.outstanding_limit == 8
    assert load_config(BrokerConfig, None, "ASY_BROKER", {"ASY_BROKER__BATCH_PROMPTS": "5"}).outstanding_limit == 10


def test_broker_rejects_bad_literal_and_bounds() -> None:
    with pytest.raises(ConfigError, match=r"log_format: Input should be 'auto', 'json' or 'text'"):
        load_config(BrokerConfig, None, "ASY_BROKER", {"ASY_BROKER__LOG_FORMAT": "xml"})
    with pytest.raises(ConfigError, match=r"sampling\.group_size: Input should be greater than or equal to 2"):
        load_config(BrokerConfig, None, "ASY_BROKER", {"ASY_BROKER__SAMPLING__GROUP_SIZE": "1"})


def test_max_steps_need_not_be_a_multiple_of_the_eval_interval() -> None:
    # The broker evaluates the final version whatever the interval (PolicyVersion.final).
    ok = load_config(StackConfig, None, "ASY_UP", {"ASY_UP__MAX_STEPS": "15", "ASY_UP__EVAL_EVERY_VERSIONS": "10"})
    assert (ok.max_steps, ok.eval_every_versions) == (15, 10)


def test_digits_only_secret_stays_a_string() -> None:
    config = load_config(Demo, None, PREFIX, {"ASY_X__NATS__PASSWORD": "007", "ASY_X__TAGS": "[a, b]"})
    assert config.nats.password is not None and config.nats.password.get_secret_value() == "007"
    assert config.tags == ["a", "b"]


@pytest.mark.parametrize(
    ("model", "prefix", "required"),
    [
        (BrokerConfig, "ASY_BROKER", {}),
        (FitterConfig, "ASY_FITTER", {}),
        (GeneratorConfig, "ASY_GENERATOR", {"ENGINE__MODEL_DIR": "/models/tiny"}),
        (LearnerConfig, "ASY_LEARNER", {"MODEL_DIR": "/models/tiny"}),
    ],
)
def test_every_service_masks_the_nats_password_in_its_log_and_dump(
    model: type[Frozen], prefix: str, required: dict[str, str], tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    secret = "pw-only-in-env-7f3a"
    env = {f"{prefix}__{k}": v for k, v in {"NATS__USER": "asy", "NATS__PASSWORD": secret, **required}.items()}
    config = load_config(model, None, prefix, env)
    caplog.set_level(logging.INFO, logger="asymptote.config")
    log_resolved(config, prefix)
    dumped = tmp_path / "config.yaml"
    dump_config(config, dumped)
    for text in (caplog.text, dumped.read_text()):
        assert secret not in text and "**********" in text
    assert secret not in repr(config)


@pytest.mark.parametrize(
    ("model", "grpc_port", "http_port"),
    [
        (BrokerConfig, 50051, 9101),
        (GeneratorConfig, 50061, 9102),
        (LearnerConfig, 50071, 9103),
        (FitterConfig, 50081, 9104),
    ],
)
def test_each_service_has_its_own_default_ports(model: type[ServiceSettings], grpc_port: int, http_port: int) -> None:
    assert model.model_fields["grpc"].default == ListenSettings(port=grpc_port)
    assert model.model_fields["http"].default == ListenSettings(port=http_port)


def test_shared_fields_take_file_and_env_values_in_every_service(tmp_path: Path) -> None:
    path = write(tmp_path, "grpc:\n  port: 6000\nnum_devices: 8\n")
    env = {"ASY_LEARNER__MODEL_DIR": "/models/tiny", "ASY_LEARNER__HTTP__PORT": "9200", "ASY_LEARNER__PREFIX": "run2"}
    config = load_config(LearnerConfig, path, "ASY_LEARNER", env)
    assert (config.grpc.port, config.http.port, config.prefix, config.num_devices) == (6000, 9200, "run2", 8)
    assert config.grpc.host == "127.0.0.1"  # the rest of the listener keeps its default
    with pytest.raises(ConfigError, match=r"prefix: String should match pattern"):
        load_config(FitterConfig, None, "ASY_FITTER", {"ASY_FITTER__PREFIX": "Run-2"})


def _models_in(annotation: object) -> list[type[BaseModel]]:
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    return [m for arg in typing.get_args(annotation) for m in _models_in(arg)]


@pytest.mark.parametrize("model", [BrokerConfig, FitterConfig, GeneratorConfig, LearnerConfig])
def test_every_config_field_has_a_description(model: type[BaseModel]) -> None:
    """Field docstrings are the descriptions of the chart's values schema; a redeclared field needs its own."""
    todo: list[type[BaseModel]] = [model]
    seen: set[type[BaseModel]] = set()
    missing: list[str] = []
    while todo:
        current = todo.pop()
        if current in seen:
            continue
        seen.add(current)
        for name, field in current.model_fields.items():
            if not field.description:
                missing.append(f"{current.__name__}.{name}")
            todo.extend(_models_in(field.annotation))
    assert not missing


@pytest.mark.parametrize(
    ("num_parameters", "lr", "warns"),
    [
        (8_000_000_000, 1e-4, True),  # the tiny model's default on an 8B model: 200x the paper's
        (1_000_000_000, 2e-5, True),
        (8_000_000_000, 5e-7, False),  # the paper's
        (8_000_000_000, 1e-5, False),  # 20x the paper's: the most that passes
        (999_999_999, 1e-4, False),
        (340_000, 1e-4, False),  # the tiny model with its own
    ],
)
def test_a_large_model_with_a_tiny_model_learning_rate_is_warned_about(
    num_parameters: int, lr: float, warns: bool, tmp_path: Path
) -> None:
    config = LearnerConfig(model_dir=tmp_path, optimizer={"lr": lr})  # type: ignore[arg-type]
    found = config.warnings(num_parameters=num_parameters)
    assert len(found) == int(warns)
    if warns:
        assert f"optimizer.lr {lr:g}" in found[0] and f"{num_parameters / 1e9:.1f}B parameters" in found[0]
        assert "5e-07" in found[0] and "100 warm-up steps" in found[0]
    assert config.warnings() == []  # the model's size unknown: nothing to compare with
