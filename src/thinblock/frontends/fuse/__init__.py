"""FUSE frontend: each volume of a pool as a file, for loop devices (`attach`)."""
