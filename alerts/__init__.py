"""Prometheus alert rules as code; the generated YAML is committed beside them."""
