"""Render every kvdiag dashboard to JSON: ``python -m kvdiag.dashboards.build --out dashboards``.

The composition root: it only builds, numbers panels and serialises (``sort_keys`` so diffs are
stable). tests/test_dashboards.py regenerates and diffs against the committed files.
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from grafana_foundation_sdk.builders import dashboard
from grafana_foundation_sdk.cog.encoder import JSONEncoder

from kvdiag.dashboards import kv_reuse, kv_transfer, router_health
from kvdiag.monitoring.config import DEFAULT_CONFIG, MixinConfig

DashboardBuilder = Callable[[MixinConfig], dashboard.Dashboard]

DASHBOARDS: dict[str, DashboardBuilder] = {
    kv_reuse.FILE_STEM: kv_reuse.build,
    kv_transfer.FILE_STEM: kv_transfer.build,
    router_health.FILE_STEM: router_health.build,
}


def render(config: MixinConfig = DEFAULT_CONFIG) -> dict[str, dict[str, Any]]:
    """Every dashboard as a JSON-ready dict, keyed by file name (``<stem>.json``)."""
    out: dict[str, dict[str, Any]] = {}
    for stem, builder in DASHBOARDS.items():
        model = json.loads(JSONEncoder(sort_keys=True).encode(builder(config).build()))
        # Grafana needs unique panel ids; number them in layout order so they never shift at random.
        for number, panel in enumerate(model["panels"], start=1):
            panel["id"] = number
        out[f"{stem}.json"] = model
    return out


def dumps(model: dict[str, Any]) -> str:
    """Serialise one dashboard exactly as the committed files are written."""
    return json.dumps(model, sort_keys=True, indent=2, ensure_ascii=False) + "\n"


def write(out_dir: Path, config: MixinConfig = DEFAULT_CONFIG) -> list[Path]:
    """Write every dashboard into ``out_dir``; return the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, model in render(config).items():
        path = out_dir / name
        path.write_text(dumps(model), encoding="utf-8")
        written.append(path)
    return written


def main(argv: list[str] | None = None) -> None:
    """Command-line entry point used by ``make generate``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=Path("dashboards"), help="directory for the JSON files")
    args = parser.parse_args(argv)
    for path in write(args.out):
        print(path)


if __name__ == "__main__":
    main()
