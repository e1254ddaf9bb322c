"""Plan searches: homogeneous enumeration, heterogeneous partitioning, provisioning."""
