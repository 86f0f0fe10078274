"""Short programs that use the package the way a reader would, run by the tests."""
