"""Grafana dashboards as code (grafana-foundation-sdk); generated JSON is committed beside them."""
