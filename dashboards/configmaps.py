"""The dashboards as Kubernetes ConfigMaps for Grafana's dashboard sidecar.

Grafana's sidecar (k8s-sidecar, as the Grafana and kube-prometheus-stack Helm charts run it) loads
every ConfigMap carrying its label, ``grafana_dashboard: "1"`` by default, and puts it in the folder
named by the ``grafana_folder`` annotation when the chart sets ``folderAnnotation``. One ConfigMap per
dashboard keeps each far below the 1 MiB ConfigMap limit and the 256 KiB that client-side
``kubectl apply`` can store in its last-applied annotation.

Usage::

    docs = configmaps(DEFAULT_CONFIG, namespace="monitoring")
    text = dumps_all(docs)      # multi-document YAML for kubectl apply -f -
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, Final

import yaml

from kvdiag.monitoring.config import MixinConfig
from kvdiag.monitoring.k8s_objects import object_meta

SIDECAR_LABEL: Final = ("grafana_dashboard", "1")
FOLDER_ANNOTATION: Final = "grafana_folder"
CONFIGMAP_LIMIT_BYTES: Final = 1 << 20
APPLY_ANNOTATION_LIMIT_BYTES: Final = 256 * 1024


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (the dashboards' JSON) as literal blocks, so the ConfigMap reads like the JSON file."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value and not any(line != line.rstrip() for line in value.splitlines()) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dumps_all(docs: list[dict[str, Any]]) -> str:
    """Multi-document YAML (``---`` between objects), keys in the order built, no line folding."""
    return "".join("---\n" + yaml.dump(doc, Dumper=_Dumper, sort_keys=False, width=100_000, allow_unicode=True)
                   for doc in docs)


def configmaps(config: MixinConfig, *, namespace: str | None = None, folder: str | None = "kvdiag",
               labels: Mapping[str, str] | None = None,
               sidecar_label: tuple[str, str] = SIDECAR_LABEL) -> list[dict[str, Any]]:
    """One ConfigMap per dashboard, each holding ``<stem>.json`` exactly as ``kvdiag dashboards export`` writes it."""
    from kvdiag.dashboards import build  # noqa: PLC0415 - needs the optional grafana-foundation-sdk

    docs = []
    extra = {**dict(labels or {}), sidecar_label[0]: sidecar_label[1]}
    annotations = {FOLDER_ANNOTATION: folder} if folder else None
    for file_name, model in build.render(config).items():
        stem = file_name.removesuffix(".json")
        body = build.dumps(model)
        docs.append({"apiVersion": "v1", "kind": "ConfigMap",
                     "metadata": object_meta(f"{config.dashboard_uid_prefix}-dashboard-{stem}", namespace, extra,
                                             annotations),
                     "data": {file_name: body}})
    return docs
