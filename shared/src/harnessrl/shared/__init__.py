"""harnessrl.shared: contracts and plumbing (events, subjects, the bus client, settings, logging, keys)."""
