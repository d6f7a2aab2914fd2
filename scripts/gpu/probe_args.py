"""The command line the demo probes share (``--model``, ``--device``): parsed into demo options (scripts/gpu only)."""

from __future__ import annotations

import argparse

from kvcanary import demo


def demo_options(description: str, default_model: str = "dense") -> demo.DemoOptions:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--model", default=default_model, choices=demo.MODEL_KINDS)
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    return demo.DemoOptions(model=args.model, device=args.device)
