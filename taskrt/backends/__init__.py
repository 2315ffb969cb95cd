"""Memory backends: allocate, copy between memories, hand out views. One file per kind."""
