"""SpotConfig: durations, validation messages, YAML, HfArgumentParser and jsonargparse."""

from __future__ import annotations

import dataclasses
import hashlib
import inspect
import json
import os
import re
import subprocess
import sys
import uuid

import pytest

from spot_callbacks import CheckpointStore, ConfigError, SpotConfig, parse_duration
from spot_callbacks.config import checked_arguments


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("15min", 900), ("1h", 3600), ("1h30min", 5400), ("2h 15m 30s", 8130), (120, 120),
     (0.5, 0.5), ("45", 45), ("1.5h", 5400), ("1d", 86400), ("10 minutes", 600)],
)  # fmt: skip
def test_durations_parse_to_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)
    assert SpotConfig(dirpath="runs/a", interval=text).interval_seconds == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["30 fortnights", "soon", "", "-5min", 0, -3, "1h-", True, [1]])
def test_bad_interval_names_the_key_the_value_and_the_accepted_forms(bad):
    with pytest.raises(ConfigError) as info:
        SpotConfig(dirpath="runs/a", interval=bad)
    message = str(info.value)
    assert "interval=" in message and repr(bad) in message
    assert "'90s'" in message and "'auto'" in message


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("1h30", 5400), ("1h 30m", 5400), ("90 min", 5400), ("PT1H30M", 5400), ("pt90s", 90), ("P1DT2H", 93600),
     ("P1W", 604800), ("PT0.5H", 1800), ("5m30", 330), ("1d12", 129600), ("1 h 30", 5400), ("1H30M", 5400)],
)  # fmt: skip
def test_common_duration_spellings_parse_to_seconds(text, seconds):
    assert parse_duration(text) == pytest.approx(seconds)
    assert SpotConfig(dirpath="runs/a", interval=text).interval_seconds == pytest.approx(seconds)


@pytest.mark.parametrize("bad", ["P", "PT", "P1H", "PT1H30", "1s30", "30 1h", "1h30 20", "1h30x", "P1DT"])
def test_a_duration_error_lists_every_accepted_form(bad):
    with pytest.raises(ConfigError) as info:
        parse_duration(bad)
    message = str(info.value)
    assert f"interval={bad!r} is not a duration" in message
    for form in ("90", "'90s'", "'90 min'", "'1.5h'", "'1h 30m'", "'1h30'", "'PT1H30M'", "'auto'", "None"):
        assert form in message
    for unit in ("d", "h", "min", "s", "m", "hr", "sec", "day", "hour", "minute", "second", "plural"):
        assert re.search(rf"\b{unit}\b", message), unit


def test_defaults_match_the_design_table():
    cfg = SpotConfig(dirpath="s3://bucket/run")
    assert (cfg.interval, cfg.every_n_steps, cfg.keep_last, cfg.scratch_dir) == ("30min", None, 3, None)
    assert (cfg.storage_options, cfg.preemption, cfg.on_preemption, cfg.interruptions_per_hour) == (
        None, "auto", "stop", None,
    )  # fmt: skip
    assert cfg.interval_seconds == 1800
    assert [f.name for f in dataclasses.fields(SpotConfig)] == [
        "dirpath", "interval", "every_n_steps", "keep_last", "scratch_dir", "storage_options",
        "preemption", "on_preemption", "interruptions_per_hour", "verbose",
    ]  # fmt: skip
    assert cfg.verbose is False  # quiet per checkpoint, as ModelCheckpoint(verbose=False)


def test_auto_and_off_intervals():
    assert SpotConfig(dirpath="d", interval="auto").interval_is_auto
    assert SpotConfig(dirpath="d", interval="auto").interval_seconds is None
    assert SpotConfig(dirpath="d", interval=None).interval_seconds is None
    assert SpotConfig(dirpath="d", interval="none").interval is None


@pytest.mark.parametrize(
    ("key", "value", "expected_words"),
    [
        ("every_n_steps", 0, "positive integer"),
        ("every_n_steps", 2.5, "positive integer"),
        ("keep_last", -1, ">= 0"),
        ("on_preemption", "pause", "'stop', 'continue'"),
        ("preemption", ["SIGTERM", "ibm"], "'aws'"),
        ("interruptions_per_hour", -0.1, ">= 0"),
        ("storage_options", "{not json", "JSON"),
        ("dirpath", "", "fsspec URL"),
        ("verbose", "yes", "true or false"),
    ],
)
def test_bad_values_name_key_and_accepted_values(key, value, expected_words):
    values = {"dirpath": "runs/a", key: value}
    with pytest.raises(ConfigError) as info:
        SpotConfig(**values)
    assert key in str(info.value) or repr(value) in str(info.value)
    assert expected_words in str(info.value)


def test_preemption_sources_are_normalised():
    assert SpotConfig(dirpath="d", preemption=["sigterm", "AWS", "SIGTERM"]).preemption == ["SIGTERM", "aws"]
    assert SpotConfig(dirpath="d", preemption=[]).preemption == []
    assert SpotConfig(dirpath="d", preemption=["auto"]).preemption == "auto"
    assert SpotConfig(dirpath="d", preemption="SIGUSR1,gcp").preemption == ["SIGUSR1", "gcp"]


def test_yaml_round_trip_and_unknown_key_suggests_the_right_one(tmp_path):
    good = tmp_path / "spot.yaml"
    good.write_text("dirpath: s3://bucket/run\ninterval: 1h30min\nkeep_last: 5\npreemption: [SIGTERM, aws]\n")
    cfg = SpotConfig.from_yaml(good)
    assert (cfg.interval_seconds, cfg.keep_last, cfg.preemption) == (5400, 5, ["SIGTERM", "aws"])

    bad = tmp_path / "typo.yaml"
    bad.write_text("dirpath: runs/a\nkeep_lst: 2\n")
    with pytest.raises(ConfigError) as info:
        SpotConfig.from_yaml(bad)
    assert "'keep_lst'" in str(info.value) and "did you mean 'keep_last'" in str(info.value)
    assert str(bad) in str(info.value)

    missing = tmp_path / "nodir.yaml"
    missing.write_text("interval: 1h\n")
    with pytest.raises(ConfigError, match="no 'dirpath'"):
        SpotConfig.from_yaml(missing)


def test_credentials_never_appear_in_repr():
    cfg = SpotConfig(
        dirpath="s3://b/r", storage_options={"key": "AKIA-SECRET-1234", "secret": "s3cr3t-VALUE"}
    )
    text = repr(cfg) + str(cfg.redacted())
    assert "AKIA-SECRET-1234" not in text and "s3cr3t-VALUE" not in text
    assert cfg.storage_options["secret"] == "s3cr3t-VALUE"


def test_storage_options_accept_a_json_string():
    cfg = SpotConfig(dirpath="s3://b/r", storage_options='{"endpoint_url": "http://127.0.0.1:9"}')
    assert cfg.storage_options == {"endpoint_url": "http://127.0.0.1:9"}


def test_hf_argument_parser_reads_spot_config_from_yaml_and_command_line(tmp_path):
    import transformers

    parser = transformers.HfArgumentParser(SpotConfig)
    path = tmp_path / "hf.yaml"
    path.write_text(
        "dirpath: gs://bucket/run\ninterval: 15min\nevery_n_steps: 100\non_preemption: continue\n"
    )
    (cfg,) = parser.parse_yaml_file(str(path))
    assert (cfg.interval_seconds, cfg.every_n_steps, cfg.on_preemption) == (900, 100, "continue")

    (cli,) = parser.parse_args_into_dataclasses(
        ["--dirpath", "s3://b/r", "--interval", "90s", "--keep_last", "1", "--preemption", "SIGTERM", "aws",
         "--storage_options", '{"anon": true}', "--interruptions_per_hour", "0.2"]
    )  # fmt: skip
    assert (cli.interval_seconds, cli.keep_last, cli.preemption) == (90, 1, ["SIGTERM", "aws"])
    assert cli.storage_options == {"anon": True} and cli.interruptions_per_hour == 0.2


def test_jsonargparse_reads_spot_config(tmp_path):
    import jsonargparse

    parser = jsonargparse.ArgumentParser(exit_on_error=False)
    parser.add_class_arguments(SpotConfig, "spot")
    path = tmp_path / "cfg.yaml"
    path.write_text("spot:\n  dirpath: az://container/run\n  interval: 2h\n  keep_last: 0\n")
    cfg = parser.instantiate(parser.parse_path(str(path))).spot
    assert isinstance(cfg, SpotConfig) and cfg.interval_seconds == 7200 and cfg.keep_last == 0
    with pytest.raises((jsonargparse.ArgumentError, ConfigError, SystemExit)):
        parser.parse_args(["--spot.dirpath", "x", "--spot.keep_last", "many"])


def test_storage_options_read_env_references_and_files_at_construction(tmp_path, monkeypatch):
    monkeypatch.setenv("SPOT_TEST_KEY", "key-from-env")
    monkeypatch.setenv("SPOT_TEST_ACCOUNT_KEY", "abc==")
    cfg = SpotConfig(
        dirpath="s3://b/r",
        storage_options={
            "key": "${SPOT_TEST_KEY}", "anon": False, "endpoint_url": "http://127.0.0.1:9",
            "connection_string": "AccountName=a;AccountKey=${SPOT_TEST_ACCOUNT_KEY};", "nested": ["${SPOT_TEST_KEY}"],
        },
    )  # fmt: skip
    assert cfg.storage_options == {
        "key": "key-from-env", "anon": False, "endpoint_url": "http://127.0.0.1:9",
        "connection_string": "AccountName=a;AccountKey=abc==;", "nested": ["key-from-env"],
    }  # fmt: skip
    assert "key-from-env" not in repr(cfg) and "abc==" not in str(cfg.redacted())

    (tmp_path / "s3.json").write_text('{"key": "k-json", "secret": "${SPOT_TEST_KEY}"}')
    (tmp_path / "s3.yaml").write_text("key: k-yaml\nclient_kwargs: {region_name: eu-west-1}\n")
    assert SpotConfig(dirpath="s3://b/r", storage_options=f"@{tmp_path / 's3.json'}").storage_options == {
        "key": "k-json", "secret": "key-from-env",
    }  # fmt: skip
    spot_yaml = tmp_path / "spot.yaml"
    spot_yaml.write_text(f"dirpath: s3://b/r\nstorage_options: '@{tmp_path / 's3.yaml'}'\n")
    assert SpotConfig.from_yaml(spot_yaml).storage_options == {
        "key": "k-yaml", "client_kwargs": {"region_name": "eu-west-1"},
    }  # fmt: skip


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"secret": "${SPOT_TEST_UNSET_VARIABLE}"},
            "refers to ${SPOT_TEST_UNSET_VARIABLE}, which is not set",
        ),
        ("@/nonexistent/s3.json", "cannot read storage_options file /nonexistent/s3.json"),
        ("@{tmp}/bad.yaml", "bad.yaml is not valid YAML at line 2"),
        ("@{tmp}/list.json", "must be a JSON object ({...}), not a list"),
        (["not", "a", "dict"], "storage_options must be a dict, a JSON object string or '@FILE'"),
    ],
)
def test_bad_storage_options_say_what_to_do_and_never_quote_a_value(tmp_path, options, message):
    (tmp_path / "bad.yaml").write_text("secret: [hunter2-hunter2\n")
    (tmp_path / "list.json").write_text('["hunter2-hunter2"]')
    if isinstance(options, str):
        options = options.format(tmp=tmp_path)
    with pytest.raises(ConfigError) as info:
        SpotConfig(dirpath="s3://b/r", storage_options=options)
    assert message in str(info.value) and "hunter2" not in str(info.value)


# ------------------------------------------------- LightningCLI: a credential reaches the store, not a file
KEY_MARKER = "AKIAENVREFERENCEMARKER7"
SECRET_MARKER = "SECRETviaENVreference93marker"
LIGHTNING_CLI = (
    "import hashlib; from lightning.pytorch.cli import LightningCLI; "
    "from lightning.pytorch.demos.boring_classes import BoringModel; cli = LightningCLI(BoringModel); "
    "[spot] = [c for c in cli.trainer.callbacks if hasattr(c, 'store')]; "
    # What the store's client signs with, as digests: the values themselves must not be printed.
    "print('credential digests', *(hashlib.sha256(v.encode()).hexdigest() for v in (spot.store.fs.key, "
    "spot.store.fs.secret)))"
)


@pytest.mark.slow
@pytest.mark.remote_store
def test_lightning_cli_credentials_from_the_environment_reach_the_store_and_no_file(tmp_path, s3_server):
    url = f"s3://{s3_server.bucket}/cli-credentials-{uuid.uuid4().hex[:8]}"
    # No ambient AWS credentials anywhere: the store is reachable only with the referenced ones.
    env = {name: value for name, value in os.environ.items() if not name.startswith("AWS_")}
    env.update(
        AWS_CONFIG_FILE=os.devnull, AWS_SHARED_CREDENTIALS_FILE=os.devnull, AWS_EC2_METADATA_DISABLED="true",
        SPOT_SCRATCH=str(tmp_path / "scratch"), PYTHONUNBUFFERED="1",
        SPOT_TEST_KEY=KEY_MARKER, SPOT_TEST_SECRET=SECRET_MARKER,
    )  # fmt: skip
    options = {
        "key": "${SPOT_TEST_KEY}",
        "secret": "${SPOT_TEST_SECRET}",
        "endpoint_url": s3_server.endpoint_url,
    }

    def lightning_cli(*argv: str, environment: dict[str, str]) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-c", LIGHTNING_CLI, "fit", *argv], cwd=tmp_path, env=environment,
            capture_output=True, text=True, timeout=300,
        )  # fmt: skip

    run = lightning_cli(
        "--trainer.max_steps=6", "--trainer.enable_progress_bar=false", "--trainer.enable_model_summary=false",
        f"--trainer.default_root_dir={tmp_path / 'root'}",
        "--trainer.logger=lightning.pytorch.loggers.CSVLogger", f"--trainer.logger.save_dir={tmp_path / 'logs'}",
        "--trainer.callbacks=spot_callbacks.lightning.SpotCheckpoint", f"--trainer.callbacks.dirpath={url}",
        "--trainer.callbacks.every_n_steps=3", "--trainer.callbacks.preemption=[SIGTERM]",
        f"--trainer.callbacks.storage_options={json.dumps(options)}",
        environment=env,
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    digests = [hashlib.sha256(marker.encode()).hexdigest() for marker in (KEY_MARKER, SECRET_MARKER)]
    assert f"credential digests {' '.join(digests)}" in run.stdout
    [saved_config] = (tmp_path / "logs").rglob("config.yaml")
    assert "${SPOT_TEST_SECRET}" in saved_config.read_text()  # the reference is saved, so a rerun reads it

    # The same saved config resumes the run: the credential comes from the environment again.
    resume = lightning_cli(
        f"--config={saved_config}", "--trainer.max_steps=9", f"--trainer.logger.save_dir={tmp_path / 'logs2'}",
        "--ckpt_path=latest", environment=env,
    )  # fmt: skip
    assert resume.returncode == 0, resume.stderr[-3000:]
    store = CheckpointStore(url, storage_options={**options, "key": KEY_MARKER, "secret": SECRET_MARKER})
    # Each run's final step is always committed; step 3 may be dropped on a loaded machine (its upload not
    # begun when step 6 was written: the newest written checkpoint wins).
    assert [info.step for info in store.committed()] in ([3, 6, 9], [6, 9])

    missing = {name: value for name, value in env.items() if name != "SPOT_TEST_SECRET"}
    failed = lightning_cli(f"--config={saved_config}", environment=missing)
    assert (
        failed.returncode != 0 and "${SPOT_TEST_SECRET}, which is not set in the environment" in failed.stderr
    )
    no_credentials = subprocess.run(
        [sys.executable, "-c", f"from spot_callbacks import CheckpointStore; from spot_callbacks.store.retry import "
         f"RetryPolicy; CheckpointStore({url!r}, storage_options={{'endpoint_url': {s3_server.endpoint_url!r}}}, "
         "retry=RetryPolicy(attempts=1)).committed()"],
        env=env, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert no_credentials.returncode != 0 and "credentials" in no_credentials.stderr.lower()

    texts = {f"{name} {stream}": getattr(done, stream) for name, done in
             (("run", run), ("resume", resume), ("missing", failed)) for stream in ("stdout", "stderr")}  # fmt: skip
    for remote in store.fs.find(store.root):  # every object: manifests, payloads, the run lock
        texts[remote] = store.fs.cat_file(remote).decode("latin-1")
    for local in tmp_path.rglob("*"):  # saved configs, logger files, scratch
        if local.is_file():
            texts[str(local)] = local.read_bytes().decode("latin-1")
    assert (
        sum(name.endswith("config.yaml") for name in texts) == 2 and sum("manifest" in n for n in texts) >= 3
    )
    leaks = [name for name, text in texts.items() if KEY_MARKER in text or SECRET_MARKER in text]
    print(f"\ncredentials: grepped {len(texts)} outputs and files, {len(leaks)} leaks")
    assert not leaks, leaks


def test_checked_arguments_names_the_public_class_for_every_wrong_call():
    class Hooks:
        @checked_arguments("SpotThing")
        def __init__(self, dirpath: str, keep_last: int = 3) -> None:
            self.keep_last = keep_last

    assert Hooks("x", keep_last=2).keep_last == 2
    expected = r"^SpotThing\(\) got an unexpected keyword argument 'keeplast' \(did you mean 'keep_last'\?\)"
    with pytest.raises(TypeError, match=expected + "; accepted: dirpath, keep_last$"):
        Hooks("x", keeplast=2)
    with pytest.raises(TypeError, match=r"^SpotThing\(\) too many positional arguments; accepted"):
        Hooks("x", 2, 3)
    parameters = list(inspect.signature(Hooks.__init__).parameters)  # what jsonargparse reads
    assert parameters == ["self", "dirpath", "keep_last"]


@pytest.mark.parametrize("adapter", ["lightning", "hf", "pytorch_lightning"])
def test_the_adapters_arguments_are_spot_configs_fields_with_the_same_types_and_defaults(adapter):
    """Names, defaults and annotations: jsonargparse, LightningCLI and HfArgumentParser read the
    adapters' own signatures, so a type that drifted from SpotConfig's refuses a documented form."""
    import importlib
    import typing

    module = importlib.import_module(f"spot_callbacks.{adapter}")
    cls = module.SpotCheckpoint if adapter != "hf" else module.SpotCheckpointCallback
    init = inspect.unwrap(cls.__init__)
    parameters = {k: v for k, v in inspect.signature(init).parameters.items() if k != "self"}
    fields = {f.name: f for f in dataclasses.fields(SpotConfig)}
    assert list(parameters) == list(fields)
    config_hints = typing.get_type_hints(SpotConfig)
    adapter_hints = typing.get_type_hints(init)
    for name, parameter in parameters.items():
        expected = fields[name].default
        assert parameter.default == (parameter.empty if expected is dataclasses.MISSING else expected), name
        assert adapter_hints[name] == config_hints[name], f"{cls.__name__}({name}): {adapter_hints[name]}"


@pytest.mark.parametrize(
    ("dirpath", "named"),
    [
        ("s3://bucket/x/./run", "'.'"),
        ("gs://bucket/x/../run", "'..'"),
        ("s3://bucket/x//run", "empty path segment"),
    ],
)
def test_a_dirpath_the_fast_client_cannot_read_back_is_refused_before_training(
    dirpath: str, named: str
) -> None:
    # boto3 and s3fs keep such keys literally; obstore's parser refuses them: every pull would fail.
    with pytest.raises(ConfigError, match=named) as refused:
        SpotConfig(dirpath=dirpath)
    assert (
        dirpath in str(refused.value)
        and "without" in str(refused.value)
        or "single slashes" in str(refused.value)
    )
