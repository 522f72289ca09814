"""See dsv4kv.ops."""
