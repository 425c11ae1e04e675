"""`graft serve`'s flags are made from ServeOptions (graft.engine.options): one default each."""
from dataclasses import MISSING, fields

from graft.cli import build_parser
from graft.engine.config import EngineConfig, add_engine_args
from graft.engine.options import PublicLimitSettings, ServeOptions, serve_options
from graft.engine.server import PublicLimits


def serve_parser():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    return sub.choices["serve"]


def test_every_option_has_its_flag_with_the_dataclass_default():
    parser = serve_parser()
    by_dest = {a.dest: a for a in parser._actions}
    for cls in (ServeOptions, PublicLimitSettings):
        for f in fields(cls):
            if f.metadata["flag"] is None:     # GRAFT_PATCHES, and the limits' own group
                continue
            action = by_dest[f.name]
            default = f.default_factory() if f.default is MISSING else f.default
            assert action.help, f.name
            if f.metadata["argparse"].get("action") == "append":    # given again and again: none is []
                assert action.default is None and default == [], f.name
            else:
                assert action.default == default, f.name


def test_every_serve_flag_is_an_engine_flag_or_an_option():
    import argparse
    engine = argparse.ArgumentParser()
    add_engine_args(engine)
    engine_dests = {a.dest for a in engine._actions}
    options = {f.name for cls in (ServeOptions, PublicLimitSettings) for f in fields(cls)}
    for action in serve_parser()._actions:
        if action.dest in ("help",):
            continue
        assert action.dest in engine_dests | options | {"no_admin"}, action.dest


def test_no_flags_make_the_dataclass_defaults_and_flags_reach_their_fields():
    parser = serve_parser()
    assert serve_options(parser.parse_args([]), {}) == ServeOptions()
    opts = serve_options(parser.parse_args(["--no-admin", "--trusted-key", "a.pem", "--trusted-key", "b.pem",
                                            "--metrics-port", "public", "--request-timeout", "5",
                                            "--tenant-header", "x-tenant"]), {"GRAFT_PATCHES": "kv-align@3.2.1"})
    assert opts.admin_port is None and opts.trusted_keys == ["a.pem", "b.pem"] and opts.metrics_port is None
    assert opts.public.request_timeout == 5 and opts.public.tenant_header == "x-tenant"
    assert opts.patches == "kv-align@3.2.1"
    # what the server enforces is what the flags said
    limits = PublicLimits.of(opts.public)
    assert isinstance(limits, PublicLimits) and limits.request_timeout == 5


def test_the_engine_paths_have_one_default():
    assert serve_parser().parse_args([]).paths == EngineConfig().paths == "fast"
