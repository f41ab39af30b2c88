"""The one configuration reader: file < environment < flags, and errors that name the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from host.daemon.config import DaemonConfig, load_config
from host.daemon.errors import DaemonConfigError


def test_defaults() -> None:
    config = load_config({}, environ={})
    assert config == DaemonConfig()
    assert config.is_supervised and config.driver == "dummy"


def test_flags_beat_environment_beat_file(tmp_path: Path) -> None:
    path = tmp_path / "wafer.toml"
    path.write_text(
        'port = 9000\nhost = "0.0.0.0"\napi_keys = ["a"]\nspeculation_depth = 2\nmulti_step_budget_ms = 40\n'
    )
    env = {"WAFER_PORT": "9001", "WAFER_API_KEYS": "b, c", "WAFER_DRIVER_ARGS": "--num-pages 64"}
    config = load_config({"port": 9002, "driver": None}, environ=env, config_path=path)
    assert config.port == 9002  # flag
    assert config.api_keys == ("b", "c")  # environment over file
    assert config.host == "0.0.0.0"  # file
    assert config.speculation_depth == 2 and config.multi_step_budget_ms == 40.0
    assert config.driver_args == ("--num-pages", "64")
    assert config.driver == "dummy"  # a None flag is unset


def test_config_file_named_by_environment(tmp_path: Path) -> None:
    path = tmp_path / "wafer.toml"
    path.write_text("max_concurrent_runs = 3\n")
    assert load_config({}, environ={"WAFER_CONFIG": str(path)}).max_concurrent_runs == 3


def test_torch_model_becomes_a_driver_option() -> None:
    config = load_config({"driver": "torch", "model": "/m.gguf", "driver_args": ["--threads", "2"]}, environ={})
    assert config.driver_argv == ("--model", "/m.gguf", "--threads", "2")


def test_a_model_with_no_driver_chosen_implies_the_torch_driver(tmp_path: Path) -> None:
    assert load_config({"model": "/m.gguf"}, environ={}).replica_drivers == ("torch",)
    assert load_config({}, environ={"WAFER_MODEL": "/m.gguf"}).driver_argv == ("--model", "/m.gguf")
    path = tmp_path / "wafer.toml"
    path.write_text('drivers = ["torch", "tcp:10.0.0.2:7000"]\n')
    # A driver chosen anywhere stays chosen.
    assert load_config({"model": "/m.gguf"}, environ={}, config_path=path).replica_drivers == (
        "torch",
        "tcp:10.0.0.2:7000",
    )
    with pytest.raises(DaemonConfigError, match="only the torch driver"):
        load_config({"model": "/m.gguf"}, environ={"WAFER_DRIVER": "dummy"})


def test_a_builtin_replica_carries_its_own_arguments(tmp_path: Path) -> None:
    path = tmp_path / "wafer.toml"
    path.write_text('drivers = ["torch --device cuda:0", "torch --device \'cuda:1\'", "tcp:10.0.0.2:7000"]\n')
    config = load_config({"model": "/m.gguf", "driver_args": ["--dtype", "bfloat16"]}, environ={}, config_path=path)
    first, second, remote = config.replica_drivers
    assert [config.driver_of(e) for e in config.replica_drivers] == ["torch", "torch", "tcp:10.0.0.2:7000"]
    assert config.driver_argv_of(first) == ("--model", "/m.gguf", "--dtype", "bfloat16", "--device", "cuda:0")
    assert config.driver_argv_of(second)[-2:] == ("--device", "cuda:1")
    assert config.driver_argv_of(remote) == ("--dtype", "bfloat16")
    assert config.is_supervised
    env = {"WAFER_DRIVERS": "dummy --num-pages 64, dummy --num-pages 128"}
    assert load_config({}, environ=env).replica_drivers == ("dummy --num-pages 64", "dummy --num-pages 128")
    for entries, said in (
        (["dummy", "tcp:10.0.0.2:7000 --device cuda"], "only a built-in driver"),
        (["torch --device 'cuda:0"], "cannot split"),
        (["tcp:10.0.0.2:7000", "tcp:10.0.0.2:7000"], "listed twice"),
        (["vllm"], "use dummy or torch"),
    ):
        with pytest.raises(DaemonConfigError, match=said) as info:
            load_config({"drivers": entries}, environ={})
        assert info.value.key == "drivers" and f"drivers[{len(entries) - 1}]" in str(info.value)


def test_drivers_list_replicas_and_replace_driver(tmp_path: Path) -> None:
    assert load_config({}, environ={}).replica_drivers == ("dummy",)
    config = load_config({"drivers": ["torch", "tcp:10.0.0.2:7000"], "model": "/m.gguf"}, environ={})
    assert config.replica_drivers == ("torch", "tcp:10.0.0.2:7000")
    assert config.driver_argv_of("torch") == ("--model", "/m.gguf") and config.driver_argv_of("tcp:10.0.0.2:7000") == ()
    assert load_config({}, environ={"WAFER_DRIVERS": "dummy, dummy"}).replica_drivers == ("dummy", "dummy")
    path = tmp_path / "wafer.toml"
    path.write_text('drivers = ["dummy", "dummy"]\n')
    assert load_config({"driver": "torch"}, environ={}, config_path=path).replica_drivers == ("torch",)  # flag wins
    path.write_text('driver = "torch"\n')
    assert load_config({"drivers": ["dummy", "dummy"]}, environ={}, config_path=path).replica_drivers == (
        "dummy",
        "dummy",
    )
    path.write_text('driver = "torch"\ndrivers = ["dummy"]\n')
    with pytest.raises(DaemonConfigError, match="driver or drivers, not both") as info:
        load_config({}, environ={}, config_path=path)
    assert info.value.key == "drivers"


@pytest.mark.parametrize(
    ("flags", "env", "key"),
    [
        ({"port": 70000}, {}, "port"),
        ({}, {"WAFER_PORT": "eighty"}, "port"),
        ({"driver": "gpu"}, {}, "driver"),
        ({"drivers": ["dummy", "gpu"]}, {}, "drivers"),
        ({"drivers": ["tcp:h:1", "tcp:h:1"]}, {}, "drivers"),  # one replica per address
        ({"drivers": [1]}, {}, "drivers"),
        ({}, {"WAFER_DRIVERS": "dummy,unix"}, "drivers"),
        ({"drivers": ["dummy"], "model": "x"}, {}, "model"),
        ({}, {"WAFER_MODEL": "x", "WAFER_DRIVER": "dummy"}, "model"),  # the dummy driver loads no model
        ({"speculation_depth": -1}, {}, "speculation_depth"),
        ({"prefix_match_unit": -16}, {}, "prefix_match_unit"),
        ({"max_decode_steps": 0}, {}, "max_decode_steps"),
        ({}, {"WAFER_MAX_DECODE_STEPS": "65"}, "max_decode_steps"),
        ({"multi_step_budget_ms": -1}, {}, "multi_step_budget_ms"),
        ({}, {"WAFER_MULTI_STEP_BUDGET_MS": "long"}, "multi_step_budget_ms"),
        ({"max_concurrent_runs": 0}, {}, "max_concurrent_runs"),
        ({"run_memory_mib": 8}, {}, "run_memory_mib"),
        ({"run_timeout_s": 0}, {}, "run_timeout_s"),
        ({}, {"WAFER_RUN_TIMEOUT_S": "soon"}, "run_timeout_s"),
        ({"log_level": "loud"}, {}, "log_level"),
        ({"api_keys": [" padded "]}, {}, "api_keys"),
        ({"api_keys": [1]}, {}, "api_keys"),
        ({"port": True}, {}, "port"),
        ({"json_object_requires_json_word": "yes"}, {}, "json_object_requires_json_word"),
        ({"json_object_requires_json_word": 1}, {}, "json_object_requires_json_word"),
        ({}, {"WAFER_JSON_OBJECT_REQUIRES_JSON_WORD": "maybe"}, "json_object_requires_json_word"),
        ({"grammar_compile_budget_s": -1}, {}, "grammar_compile_budget_s"),
        ({"no_such_key": 1}, {}, "no_such_key"),
    ],
)
def test_bad_values_name_the_key(flags: dict[str, object], env: dict[str, str], key: str) -> None:
    with pytest.raises(DaemonConfigError) as info:
        load_config(flags, environ=env)
    assert info.value.key == key
    assert repr(key) in str(info.value)


def test_bad_file(tmp_path: Path) -> None:
    path = tmp_path / "wafer.toml"
    path.write_text("port = [\n")
    with pytest.raises(DaemonConfigError, match="not valid TOML"):
        load_config({}, environ={}, config_path=path)
    path.write_text("prot = 1\n")
    with pytest.raises(DaemonConfigError) as info:
        load_config({}, environ={}, config_path=path)
    assert info.value.key == "prot"
    with pytest.raises(DaemonConfigError, match="cannot read"):
        load_config({}, environ={}, config_path=tmp_path / "missing.toml")
    path.write_text('port = "80"\n')  # a file has types: a string is not a port
    with pytest.raises(DaemonConfigError) as info:
        load_config({}, environ={}, config_path=path)
    assert info.value.key == "port"


def test_booleans_from_file_flags_and_environment(tmp_path: Path) -> None:
    assert load_config({}, environ={}).json_object_requires_json_word is False
    assert load_config({"json_object_requires_json_word": True}, environ={}).json_object_requires_json_word
    env = {"WAFER_JSON_OBJECT_REQUIRES_JSON_WORD": "on"}
    assert load_config({}, environ=env).json_object_requires_json_word
    path = tmp_path / "wafer.toml"
    path.write_text("json_object_requires_json_word = true\ngrammar_compile_budget_s = 2.5\n")
    config = load_config({}, environ={}, config_path=path)
    assert config.json_object_requires_json_word and config.grammar_compile_budget_s == 2.5


def test_data_dir_follows_cache_dir(tmp_path: Path) -> None:
    config = load_config({"cache_dir": str(tmp_path)}, environ={})
    assert config.data_dir == tmp_path / "daemon"
    assert load_config({"cache_dir": str(tmp_path), "data_dir": "/srv/x"}, environ={}).data_dir == Path("/srv/x")


def test_serve_takes_the_model_as_its_argument(monkeypatch: pytest.MonkeyPatch) -> None:
    """`wafer serve MODEL`, as vLLM's and llama.cpp's users type it: the torch driver loads MODEL."""
    from host.cli.commands import build_parser
    from host.daemon.cli import config_of

    for key in [k for k in os.environ if k.startswith("WAFER_")]:
        monkeypatch.delenv(key)
    parser, _ = build_parser()
    config = config_of(parser.parse_args(["serve", "/models/m.gguf", "--served-model-name", "m"]))
    assert config.replica_drivers == ("torch",) and config.driver_argv == ("--model", "/models/m.gguf")
    assert config.served_model_name == "m"
    assert config_of(parser.parse_args(["serve"])).replica_drivers == ("dummy",)  # no model: the dummy as before
    with pytest.raises(DaemonConfigError, match="two models"):
        config_of(parser.parse_args(["serve", "/a.gguf", "--model", "/b.gguf"]))


def test_run_limits_reach_the_sandbox() -> None:
    """Every per-run bound of the limits table has its key, and the sandbox gets it."""
    keys = {
        "run_max_tables": 2,
        "run_max_table_slots": 1000,
        "run_max_instances": 20,
        "run_max_log_kib": 8,
        "run_max_grammars": 3,
        "run_max_grammar_mib": 5,
        "run_max_matchers": 6,
        "run_max_matcher_tokens": 700,
    }
    sandbox = load_config(keys, environ={}).sandbox_config()
    limits = sandbox.host_limits
    assert (sandbox.max_tables, sandbox.max_table_elements, sandbox.max_instances) == (2, 1000, 20)
    assert (limits.log_bytes, limits.stdio_log_bytes) == (8 * 1024, 8 * 1024)
    assert (limits.grammars, limits.grammar_bytes, limits.matchers, limits.matcher_tokens) == (3, 5 << 20, 6, 700)
    # Tables come out of the run's memory: too many slots for it is refused at load.
    with pytest.raises(DaemonConfigError, match="once the tables") as info:
        load_config({"run_memory_mib": 32, "run_max_table_slots": 1 << 20}, environ={})
    assert info.value.key == "run_memory_mib"
    with pytest.raises(DaemonConfigError, match="at least completions_max_prompts"):
        load_config({"completions_max_prompts": 10, "completions_max_choices": 5}, environ={})


def test_every_key_is_documented() -> None:
    from host.daemon.config import KEYS

    text = (Path(__file__).resolve().parents[3] / "docs" / "operating.md").read_text()
    missing = [key for key in KEYS if f"`{key}`" not in text]
    assert not missing, f"docs/operating.md names no {missing}"
