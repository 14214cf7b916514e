"""nmoe: Mixture-of-Experts training as a spec-and-parity harness."""
