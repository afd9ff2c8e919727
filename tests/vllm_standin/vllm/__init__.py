"""Stand-in for vLLM's package (tests only): the names kvwire's connector imports."""
