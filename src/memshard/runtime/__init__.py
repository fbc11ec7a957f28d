"""Running a memshard plan for real: launching ranks, executing, resharding and measuring."""
