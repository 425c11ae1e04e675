"""Where /metrics is served: a port of its own by default (its series name each engine's revision,
which the public port's clients must not read), the public port only when asked with
`--metrics-port public`, and a metrics port that is another server's refused before the model loads."""
from __future__ import annotations

import argparse

import httpx
import pytest

from graft.cli import build_parser
from graft.engine.launcher import flag_value
from graft.engine.serve import ServeOptions, check_ports
from tests.support import metric_value, start_engine


def serve_args(*args: str) -> argparse.Namespace:
    return build_parser().parse_args(["serve", *args])


def test_metrics_have_a_port_of_their_own_unless_public_is_asked():
    assert serve_args().metrics_port == ServeOptions().metrics_port == 9400
    assert serve_args().metrics_host is None
    assert serve_args("--metrics-port", "9500").metrics_port == 9500
    assert serve_args("--metrics-port", "public").metrics_port is None


@pytest.mark.parametrize("value", ["0", "65536", "-1", "nine", ""])
def test_a_metrics_port_is_a_port_number_or_public(value, capsys):
    with pytest.raises(SystemExit):
        serve_args("--metrics-port", value)
    assert "--metrics-port" in capsys.readouterr().err


@pytest.mark.parametrize("opts,says", [
    (ServeOptions(port=9400), "--metrics-port 9400 is also --port"),
    (ServeOptions(metrics_port=8081), "--metrics-port 8081 is also --admin-port"),
    (ServeOptions(host="127.0.0.1", metrics_host="0.0.0.0", metrics_port=8000), "is also --port"),
    (ServeOptions(metrics_port=None, metrics_host="10.0.0.1"), "--metrics-host"),
    (ServeOptions(metrics_port=70000), "from 1 to 65535"),
])
def test_a_metrics_port_that_is_another_servers_is_refused_before_the_model_loads(opts, says):
    with pytest.raises(SystemExit) as refused:
        check_ports(opts)
    assert says in str(refused.value)


@pytest.mark.parametrize("opts", [
    ServeOptions(),
    ServeOptions(metrics_port=None),
    ServeOptions(metrics_port=8081, admin_port=None),
    ServeOptions(host="10.0.0.1", metrics_host="127.0.0.1", metrics_port=8000),
])
def test_ports_apart_are_accepted(opts):
    check_ports(opts)


def test_the_launcher_reads_the_metrics_port_as_argparse_does():
    assert flag_value([], "--metrics-port") is None
    assert flag_value(["--metrics-port", "public"], "--metrics-port") == "public"
    assert flag_value(["--metrics-port=1", "--dtype", "float32", "--metrics-port", "2"], "--metrics-port") == "2"
    assert flag_value(["--metrics-port"], "--metrics-port") is None


@pytest.mark.slow
def test_metrics_port_public_serves_them_on_the_public_port_as_one_port(tmp_path):
    eng = start_engine(tmp_path, "--metrics-port", "public")
    try:
        assert eng.metrics_port is None and eng.metrics_url == eng.url
        reply = httpx.get(eng.url + "/metrics", timeout=10)
        assert reply.status_code == 200
        assert metric_value(reply.text, "graft_engine_revision_info", revision="base") == 1
    finally:
        eng.stop()
