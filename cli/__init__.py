"""The thin click CLI: parse options, call the library, print."""
