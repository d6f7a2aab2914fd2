"""The command line the demo probes share (``--model``, ``--device``), parsed into demo options (scripts/gpu only)."""

from __future__ import annotations

import argparse

from kvcanary import demo


def demo_parser(description: str, default_model: str = "dense") -> argparse.ArgumentParser:
    """The shared ``--model`` and ``--device`` options; a probe adds its own before parsing."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=default_model, choices=demo.MODEL_KINDS)
    p.add_argument("--device", default="cuda")
    return p


def options_of(args: argparse.Namespace, **extra: object) -> demo.DemoOptions:
    """The demo options the parsed ``args`` name (and ``extra`` fields of :class:`~kvcanary.demo.DemoOptions`)."""
    return demo.DemoOptions(model=args.model, device=args.device, **extra)


def demo_options(description: str, default_model: str = "dense") -> demo.DemoOptions:
    """For a probe with no options of its own: parse the shared ones."""
    return options_of(demo_parser(description, default_model).parse_args())
