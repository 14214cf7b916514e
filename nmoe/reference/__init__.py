"""The spec: CPU pure-PyTorch reference of every op, readable like math."""
