"""Internal: Kubernetes object metadata both exports share (the dashboards' ConfigMaps, the alerts' PrometheusRule):
names, namespaces and labels validated as the API server would, and kvdiag's own labels.

Usage::

    meta = object_meta("kvdiag-alerts", "monitoring", parse_labels(["release=prometheus"]))
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any, Final

from kvdiag.monitoring.config import MonitoringConfigError

MANAGED_BY: Final = {"app.kubernetes.io/part-of": "kvdiag", "app.kubernetes.io/managed-by": "kvdiag"}

_DNS_LABEL: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_DNS_SUBDOMAIN: Final = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_LABEL_NAME: Final = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")


def check_name(value: str, what: str = "--name") -> str:
    """A Kubernetes object name (DNS-1123 subdomain, at most 253 characters); raise MonitoringConfigError otherwise."""
    if len(value) > 253 or not _DNS_SUBDOMAIN.match(value):
        raise MonitoringConfigError(f"{what} {value!r} is not a Kubernetes object name: use lower-case letters, "
                                    "digits, '-' and '.', starting and ending with a letter or digit")
    return value


def check_namespace(value: str) -> str:
    """A namespace name (DNS-1123 label, at most 63 characters)."""
    if len(value) > 63 or not _DNS_LABEL.match(value):
        raise MonitoringConfigError(f"--namespace {value!r} is not a namespace name: lower-case letters, digits "
                                    "and '-', at most 63 characters")
    return value


def check_label(key: str, value: str) -> tuple[str, str]:
    """A label ``key=value`` as Kubernetes accepts it (optional DNS prefix, 63-character name and value)."""
    prefix, _, name = key.rpartition("/")
    if (prefix and (len(prefix) > 253 or not _DNS_SUBDOMAIN.match(prefix))) or len(name) > 63 or not (
            _LABEL_NAME.match(name)):
        raise MonitoringConfigError(f"label key {key!r} is not valid: [prefix/]name, name up to 63 characters of "
                          "letters, digits, '-', '_' and '.'")
    if len(value) > 63 or (value and not _LABEL_NAME.match(value)):
        raise MonitoringConfigError(f"label {key}={value!r}: a value is up to 63 letters, digits, '-', '_' or '.', "
                          "starting and ending with a letter or digit")
    return key, value


def parse_labels(items: tuple[str, ...] | list[str]) -> dict[str, str]:
    """``["release=prometheus", ...]`` as a validated label map."""
    out: dict[str, str] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep:
            raise MonitoringConfigError(f"--label {item!r}: write KEY=VALUE (e.g. release=prometheus)")
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
