"""The instrumented, stateful P/D router for bidirectional KV reuse."""
