"""The dashboards as Kubernetes ConfigMaps for Grafana's dashboard sidecar, and the object-metadata rules both
Kubernetes exports share.

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

import re
from collections.abc import Mapping
from typing import Any, Final

import yaml

from kvdiag.dashboards.config import ConfigError, MixinConfig

SIDECAR_LABEL: Final = ("grafana_dashboard", "1")
FOLDER_ANNOTATION: Final = "grafana_folder"
MANAGED_BY: Final = {"app.kubernetes.io/part-of": "kvdiag", "app.kubernetes.io/managed-by": "kvdiag"}
CONFIGMAP_LIMIT_BYTES: Final = 1 << 20
APPLY_ANNOTATION_LIMIT_BYTES: Final = 256 * 1024

_DNS_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME: Final = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def check_name(value: str, what: str = "--name") -> str:
    """A Kubernetes object name (DNS-1123 subdomain, at most 253 characters); raise ConfigError otherwise."""
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise ConfigError(f"{what} {value!r} is not a Kubernetes object name: use lower-case letters, digits, "
                          "'-' and '.', starting and ending with a letter or digit")
    return value


def check_namespace(value: str) -> str:
    """A namespace name (DNS-1123 label, at most 63 characters)."""
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise ConfigError(f"--namespace {value!r} is not a namespace name: lower-case letters, digits and '-', "
                          "at most 63 characters")
    return value


def check_label(key: str, value: str) -> tuple[str, str]:
    """A label ``key=value`` as Kubernetes accepts it (optional DNS prefix, 63-character name and value)."""
    prefix, _, name = key.rpartition("/")
    if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or len(name) > 63 or not (
            _LABEL_NAME.match(name)):
        raise ConfigError(f"label key {key!r} is not valid: [prefix/]name, name up to 63 characters of "
                          "letters, digits, '-', '_' and '.'")
    if len(value) > 63 or (value and not _LABEL_NAME.match(value)):
        raise ConfigError(f"label {key}={value!r}: a value is up to 63 letters, digits, '-', '_' or '.', "
                          "starting and ending with a letter or digit")
    return key, value


def parse_labels(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``["release=prometheus", ...]`` as a validated label map."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--label {item!r}: write KEY=VALUE (e.g. release=prometheus)")
        k, v = check_label(key.strip(), value.strip())
        out[k] = v
    return out


def object_meta(name: str, namespace: str | None, labels: Mapping[str, str],
                annotations: Mapping[str, str] | None = None) -> dict[str, Any]:
    """``metadata`` of one exported object (validated)."""
    meta: dict[str, Any] = {"name": check_name(name)}
    if namespace:
        meta["namespace"] = check_namespace(namespace)
    meta["labels"] = dict(check_label(k, v) for k, v in {**MANAGED_BY, **labels}.items())
    if annotations:
        meta["annotations"] = dict(annotations)
    return meta


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
