"""harnessrl.shared: contracts, subjects, bus client, settings, logging, keys and test fixtures."""
