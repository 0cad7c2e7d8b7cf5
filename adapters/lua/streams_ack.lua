-- ARGV: group, consumer, then ack ids. Returns the stale positions (1-based).
return ack_owned(3)
