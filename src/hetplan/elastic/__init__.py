"""Elastic training on spot instances: replanning, recovery plans, shard storage."""
