"""SpotConfig: durations, validation messages, YAML, HfArgumentParser and jsonargparse."""

from __future__ import annotations

import dataclasses

import pytest

from spot_callbacks import ConfigError, SpotConfig, parse_duration


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


def test_defaults_match_the_design_table():
    cfg = SpotConfig(dirpath="s3://bucket/run")
    assert (cfg.interval, cfg.every_n_steps, cfg.keep_last, cfg.scratch_dir) == ("30min", None, 3, None)
    assert (cfg.storage_options, cfg.preemption, cfg.on_preemption, cfg.interruptions_per_hour) == (
        None, "auto", "stop", None,
    )  # fmt: skip
    assert cfg.interval_seconds == 1800
    assert [f.name for f in dataclasses.fields(SpotConfig)] == [
        "dirpath", "interval", "every_n_steps", "keep_last", "scratch_dir", "storage_options",
        "preemption", "on_preemption", "interruptions_per_hour",
    ]  # fmt: skip


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
