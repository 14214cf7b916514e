"""One module per op family: its input space, builders, oracle and OpEntry declarations."""
