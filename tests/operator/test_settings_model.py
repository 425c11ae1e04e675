"""`graft operator`'s settings are declared once (graft.operator.settings): every setting has an
environment variable and a flag, and either way a value meets the same checks, refused alike."""
from dataclasses import MISSING, fields

import pytest

from graft.operator.main import build_parser, main_operator
from graft.operator.settings import OperatorSettings

TLS = {"GRAFT_ADMIN_CA_FILE": "/etc/graft/ca.pem"}      # so the admin API's TLS setting is not what is refused
SETTINGS = [(f.name, f.type, f.metadata["setting"]) for f in fields(OperatorSettings)]


def refusal(capsys, argv: list[str], env: dict[str, str]) -> str:
    with pytest.raises(SystemExit) as exit:
        main_operator(argv, env=env)
    assert exit.value.code == 2
    return capsys.readouterr().err.strip().splitlines()[-1]


def test_tick_zero_is_refused_alike_as_a_flag_and_as_a_variable(capsys):
    by_flag = refusal(capsys, ["--tick", "0"], TLS)
    by_env = refusal(capsys, [], {**TLS, "GRAFT_TICK_SECONDS": "0"})
    assert by_flag == by_env
    assert by_flag.endswith("GRAFT_TICK_SECONDS (--tick) must be positive, got 0")


def out_of_bounds(how) -> list[str]:
    """Values the declaration itself says are refused."""
    bad = ["soon"]
    if how.positive:
        bad.append("0")
    if how.minimum is not None:
        bad.append(f"{how.minimum - 1:g}")
    if how.maximum is not None:
        bad.append(f"{how.maximum + 1:g}")
    return bad


# metrics_port 0 is no bound's breach: it is the documented "not served" (the minimum-1 case says 0)
BOUNDED = [(name, how, value) for name, kind, how in SETTINGS if kind in ("float", "int", "int | None")
           for value in out_of_bounds(how) if (name, value) != ("metrics_port", "0")]


@pytest.mark.parametrize("name,how,value", BOUNDED, ids=[f"{n}={v}" for n, _, v in BOUNDED])
def test_every_bound_refuses_a_flag_and_its_variable_with_the_same_message(capsys, name, how, value):
    by_flag = refusal(capsys, [how.flag_of(name), value], TLS)
    by_env = refusal(capsys, [], {**TLS, how.env: value})
    assert by_flag == by_env and how.env in by_flag and how.flag_of(name) in by_flag


def test_every_setting_has_a_variable_and_a_flag_but_the_secret_only_a_variable():
    parser_flags = {option for action in build_parser()._actions for option in action.option_strings}
    envs = [how.env for _, _, how in SETTINGS]
    assert len(set(envs)) == len(envs) and all(e.startswith("GRAFT_") for e in envs)
    no_flag = {name for name, _, how in SETTINGS if how.flag_of(name) is None}
    # a secret on a command line is visible to every user of the machine: the token has a variable
    # alone, and every setting given so is said in --help
    assert "admin_token" in no_flag
    epilog = " ".join(build_parser().epilog.split())
    for name, _, how in SETTINGS:
        assert (how.env in epilog) == (name in no_flag), name
    for name, _, how in SETTINGS:
        assert how.help, name
        if name not in no_flag:
            assert how.flag_of(name) in parser_flags, name
    shown = " ".join(build_parser().format_help().split())
    for env in envs:                    # `graft operator --help` names every variable
        assert env in shown, env


def test_defaults_are_the_declared_ones_and_a_flag_reads_as_its_variable():
    settings = OperatorSettings.from_args(build_parser().parse_args([]), TLS)
    for f in fields(OperatorSettings):
        default = f.default_factory() if f.default is MISSING else f.default
        if f.name not in ("admin_ca_file",):
            assert getattr(settings, f.name) == default, f.name
    argv = ["--namespace", "a", "-n", "b,c", "--tick", "2.5", "--admin-port", "9000", "--admin-plain-http",
            "--admin-scheme", "http", "--metrics-port", "9100", "--prometheus-allowed", "https://p.obs:9443/x"]
    env = {"GRAFT_NAMESPACES": "a,b,c", "GRAFT_TICK_SECONDS": "2.5", "GRAFT_ADMIN_PORT": "9000",
           "GRAFT_ADMIN_PLAIN_HTTP": "true", "GRAFT_ADMIN_SCHEME": "http", "GRAFT_METRICS_PORT": "9100",
           "GRAFT_PROMETHEUS_ALLOWED": "https://p.obs:9443/x"}
    by_flags = OperatorSettings.from_args(build_parser().parse_args(argv), {})
    assert by_flags == OperatorSettings.from_env(env)
    assert by_flags.namespaces == ["a", "b", "c"] and by_flags.tick == 2.5 and by_flags.metrics_port == 9100
    # a flag wins over its variable
    assert OperatorSettings.from_args(build_parser().parse_args(["--tick", "1"]),
                                      {**TLS, "GRAFT_TICK_SECONDS": "9"}).tick == 1
