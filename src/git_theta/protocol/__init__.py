"""Git's pkt-line framing and the long-running filter protocol: bytes only, no tensors."""
