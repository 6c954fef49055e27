"""Internal: what the dashboards and the alert rules share, their one config and the Kubernetes object metadata."""
