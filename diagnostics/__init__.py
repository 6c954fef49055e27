"""Log parsers, the correlator and the verdict classifier behind explain, report and advise."""
