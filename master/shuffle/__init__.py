"""An epoch's shuffled record order, pure in (size, seed, epoch): computed by the master for
the shards it hands out and by a node for the shards it is handed (`record_indices`)."""
