"""``jaxdist`` command line.

    jaxdist train [--config FILE] [KEY=VALUE ...]    train (resumes a run that has checkpoints)
    jaxdist config [--config FILE] [KEY=VALUE ...]   print the resolved config as TOML
    jaxdist config --reference                       print the configuration reference (Markdown)

Overrides are dotted keys: ``train.steps=200 mesh.tensor=2 model=tiny``.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tomllib
from pathlib import Path

from jaxdist.config import Config, ConfigError, load_config, reference_markdown

MESHES_DIR = Path(__file__).resolve().parents[1] / "meshes"


def _simulated_devices(cfg: Config) -> int | None:
    """Host devices to simulate for a CPU cluster description (per process), else None."""
    path = Path(cfg.mesh.cluster)
    if not path.suffix:
        path = MESHES_DIR / f"{cfg.mesh.cluster}.toml"
    try:
        spec = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError):
        return None  # load_cluster reports the problem with a proper message later
    if str(spec.get("device_kind", "")).lower() != "cpu":
        return None
    return int(spec.get("devices_per_node", 1))


def prepare_host_devices(cfg: Config) -> None:
    """Before JAX is imported: make XLA simulate the CPU devices the cluster file describes."""
    n = _simulated_devices(cfg)
    flags = os.environ.get("XLA_FLAGS", "")
    if n and "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def _toml(d: dict, prefix: str = "") -> str:
    out = []
    for section, values in d.items():
        out.append(f"[{section}]")
        for k, v in values.items():
            out.append(f"{k} = {json.dumps(v)}")
        out.append("")
    return "\n".join(out)


def cmd_config(args) -> int:
    if args.reference:
        print(reference_markdown())
        return 0
    cfg = load_config(args.config, args.overrides)
    print(_toml(cfg.to_dict()))
    return 0


def cmd_train(args) -> int:
    cfg = load_config(args.config, args.overrides)
    prepare_host_devices(cfg)
    from jaxdist.train.distributed import initialize_from_env

    initialize_from_env()
    import jax

    from jaxdist.train.trainer import Trainer

    with Trainer(cfg) as trainer:
        if jax.process_index() == 0:
            print(trainer.describe(), file=sys.stderr)
        trainer.init_state()
        start = int(jax.device_get(trainer.state["step"]))
        if start and jax.process_index() == 0:
            print(f"resuming at step {start}", file=sys.stderr)
        history = trainer.fit()
        # evaluate() is a collective over every process's devices: all processes call it.
        eval_loss = trainer.evaluate() if history else float("nan")
        if jax.process_index() == 0 and history:
            first, last = history[0], history[-1]
            print(f"steps {first['step']}..{last['step']}: loss {first['loss']:.3f} -> {last['loss']:.3f}, "
                  f"eval loss {eval_loss:.3f}, {last['tokens_per_s']:.0f} tokens/s; "
                  f"outputs in {trainer.run_dir}", file=sys.stderr)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxdist", description="Train large models on device meshes.")
    sub = p.add_subparsers(dest="command", required=True)

    t = sub.add_parser("train", help="train a model (resumes from the run's checkpoints)")
    t.add_argument("--config", help="TOML config file")
    t.set_defaults(fn=cmd_train)

    c = sub.add_parser("config", help="print the resolved config, or the reference")
    c.add_argument("--config", help="TOML config file")
    c.add_argument("--reference", action="store_true", help="print the configuration reference")
    c.set_defaults(fn=cmd_config)
    return p


def main(argv: list[str] | None = None) -> int:
    # Everything argparse does not know is a KEY=VALUE (or --KEY VALUE) override.
    args, args.overrides = build_parser().parse_known_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.fn(args)
    except ConfigError as e:
        print(f"jaxdist: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
