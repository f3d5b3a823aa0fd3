"""3D resharding: the plan of which training shards each engine rank receives, and its execution in buckets."""
