"""Running a runner's steps in lockstep across the ranks of a process group."""
