"""Single sources of truth: the event schema, the verdict names and the metric catalog."""
