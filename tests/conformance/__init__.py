"""Release conformance tests: a package, so that their module names do not collide with tests/test_*.py."""
