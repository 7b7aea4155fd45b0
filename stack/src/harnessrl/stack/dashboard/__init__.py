"""`harnessrl dashboard`: a live web page of a run read from the bus (`app`), its data (`state`, `tokens`)."""
