"""Live deployment check: probe a running router and P/D engines and say what is misconfigured."""
