"""The AWS path: pre-flight checks, the Pulumi Automation API driver, and the teardown sweep."""
