"""Logs in object storage: ``s3://bucket/prefix`` (every object under it), ``s3://bucket/key``, or a glob.

Objects are copied into a local mirror (``<dir>/<bucket>/<key>``) before they are read, as ``aws s3
sync`` would: an object whose ETag and size match the mirror's copy is not fetched again, and each
copy keeps the object's LastModified as its mtime (so report's cache key stays the same across runs).
Needs boto3 (``pip install 'kvdiag[s3]'``); credentials, region and endpoint come from boto3's usual
sources (``AWS_ACCESS_KEY_ID`` / ``AWS_SECRET_ACCESS_KEY``, ``AWS_PROFILE``, ``AWS_REGION``,
``AWS_ENDPOINT_URL_S3`` or ``AWS_ENDPOINT_URL`` for an S3-compatible server such as MinIO).
"""

from __future__ import annotations

import fnmatch
import glob
import importlib
import json
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final

from kvdiag.diagnostics.detect import LogReadError

SCHEME: Final = "s3://"
MAX_OBJECTS: Final = 100_000
_MANIFEST: Final = ".kvdiag-mirror.json"
_HINT: Final = ("check the URL and the credentials (AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY or AWS_PROFILE; "
                "AWS_ENDPOINT_URL_S3 for an S3-compatible server)")


def is_object_url(spec: str) -> bool:
    """True for an ``s3://`` input."""
    return spec.startswith(SCHEME)


@dataclass(frozen=True)
class MirroredObject:
    """One object and its local copy."""

    url: str
    local_path: str
    size: int


def parse_url(url: str) -> tuple[str, str]:
    """(bucket, key or prefix) of ``s3://bucket/key``; raise LogReadError for a URL without a bucket."""
    rest = url[len(SCHEME):]
    bucket, _, key = rest.partition("/")
    if not bucket:
        raise LogReadError(f"cannot read {url}: no bucket in the URL (expected s3://bucket/prefix)")
    return bucket, key


def _client() -> Any:
    try:  # optional: only s3:// inputs need it (an import by name: the package ships no type stubs)
        boto3: Any = importlib.import_module("boto3")
        config: Any = importlib.import_module("botocore.config")
    except ImportError:
        raise LogReadError("reading s3:// inputs needs boto3: pip install 'kvdiag[s3]'") from None
    return boto3.session.Session().client("s3", config=config.Config(retries={"max_attempts": 3, "mode": "standard"}))


def _why(exc: Exception) -> str:
    response = getattr(exc, "response", None)
    if isinstance(response, dict):
        err = response.get("Error", {})
        code, message = err.get("Code"), err.get("Message")
        if code:
            return f"{code}: {message}" if message and message != code else str(code)
    return str(exc) or type(exc).__name__


def list_objects(client: Any, url: str) -> Iterator[tuple[str, int, str, float]]:
    """(key, size, etag, last-modified epoch) of the objects ``url`` names, in key order."""
    bucket, key = parse_url(url)
    literal = key[:min([key.index(c) for c in "*?[" if c in key] or [len(key)])]
    pattern = key if glob.has_magic(key) else None
    paginator = client.get_paginator("list_objects_v2")
    count = 0
    for page in paginator.paginate(Bucket=bucket, Prefix=literal):
        for obj in page.get("Contents", []):
            k = obj["Key"]
            if k.endswith("/"):
                continue  # a folder marker
            if pattern is not None and not fnmatch.fnmatchcase(k, pattern):
                continue
            # s3://b/logs/p.log names that object; s3://b/logs (or logs/) everything under logs/
            if pattern is None and key and k != key and not key.endswith("/") and not k.startswith(key + "/"):
                continue
            count += 1
            if count > MAX_OBJECTS:
                raise LogReadError(f"cannot read {url}: more than {MAX_OBJECTS:,} objects; narrow the prefix")
            yield k, int(obj["Size"]), str(obj.get("ETag", "")), obj["LastModified"].timestamp()


def mirror(url: str, mirror_dir: Path) -> list[MirroredObject]:
    """Copy the objects ``url`` names into ``mirror_dir`` (skipping unchanged copies); raise LogReadError."""
    bucket, _ = parse_url(url)
    client = _client()
    root = mirror_dir / bucket
    manifest_path = root / _MANIFEST
    try:
        manifest: dict[str, Any] = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        manifest = {}
    out: list[MirroredObject] = []
    try:
        objects = list(list_objects(client, url))
        for key, size, etag, modified in objects:
            local = root / key
            if not _inside(local, root):
                raise LogReadError(f"cannot read {SCHEME}{bucket}/{key}: the key leaves the mirror folder")
            seen = manifest.get(key)
            fresh = (seen == {"etag": etag, "size": size} and local.is_file() and local.stat().st_size == size)
            if not fresh:
                local.parent.mkdir(parents=True, exist_ok=True)
                tmp = local.with_name(local.name + ".part")
                client.download_file(bucket, key, str(tmp))
                os.utime(tmp, (modified, modified))
                tmp.replace(local)
                manifest[key] = {"etag": etag, "size": size}
            out.append(MirroredObject(url=f"{SCHEME}{bucket}/{key}", local_path=str(local), size=size))
    except LogReadError:
        raise
    except OSError as exc:
        raise LogReadError(f"cannot copy {url} to {root}: {exc.strerror or exc}") from None
    except Exception as exc:  # botocore's errors (ClientError, NoCredentialsError, EndpointConnectionError)
        raise LogReadError(f"cannot read {url}: {_why(exc)}; {_HINT}") from None
    finally:
        if manifest:
            try:
                root.mkdir(parents=True, exist_ok=True)
                manifest_path.write_text(json.dumps(manifest, sort_keys=True), encoding="utf-8")
            except OSError:
                pass  # the next run fetches again
    if not out:
        raise LogReadError(f"no object matches {url}; {_HINT}")
    return out


def _inside(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True
