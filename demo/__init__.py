"""`kvdiag demo`: start P, D and the router on loopback, run a workload, summarize."""
