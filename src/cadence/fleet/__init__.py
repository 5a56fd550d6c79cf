"""cadence's fleet: N engines behind one OpenAI endpoint, on Ray Serve (docs/fleet.md).

`cadence serve --replicas N` runs it; for `serve run` and `serve deploy`, `app` is a Serve
application builder taking the same options as `cadence serve`'s flags (without the dashes):

    serve run cadence.fleet:app replicas=2 router=prefix-affinity max-num-seqs=32
    serve deploy examples/fleet_serve_config.yaml

Importing this package imports nothing of Ray; `app` does.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping
from typing import Any


def serve_argv(args: Mapping[str, Any], known: Collection[str]) -> list[str]:
    """`cadence serve` flags for Serve's builder arguments: {"max-num-seqs": 32, "tiny": True}
    gives ["--max-num-seqs", "32", "--tiny"]. A false boolean is `--no-FLAG` where the flag has
    that form (in `known`), else left out (false is a plain flag's default)."""
    argv: list[str] = []
    for key, value in args.items():
        flag = "--" + str(key).replace("_", "-")
        text = str(value).lower() if isinstance(value, (bool, str)) else None
        if text == "true":
            argv.append(flag)
        elif text == "false":
            if "--no-" + flag[2:] in known:
                argv.append("--no-" + flag[2:])
        else:
            argv += [flag, str(value)]
    return argv


def app(args: Mapping[str, Any] | None = None) -> Any:
    """The fleet as a Ray Serve application (`serve run cadence.fleet:app key=value ...`)."""
    from cadence.cli import fleet_options, serve_configs, serve_parser
    from cadence.fleet.deploy import build_fleet

    parser = serve_parser()
    argv = serve_argv(args or {}, parser._option_string_actions)
    try:
        parsed = parser.parse_args(argv)
    except SystemExit:  # (argparse has printed why)
        raise ValueError(f"cadence.fleet:app: bad arguments {argv}") from None
    engine_cfg, server_cfg = serve_configs(parsed)
    engine_cfg, fleet = fleet_options(parsed, engine_cfg)
    return build_fleet(engine_cfg, server_cfg, fleet)
