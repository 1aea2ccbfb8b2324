"""The cluster's AWS resources, one ComponentResource per concern.

`infra.program.build_cluster` assembles them in dependency order: network -> security -> storage ->
identity -> compute -> expiry. Nothing here creates a resource at import time, so the program can be
run under Pulumi's mocks (`infra.offline`) as well as by `pulumi up`.
"""
