"""Ceph: the cluster connection shared by the RADOS data and metadata stores."""
