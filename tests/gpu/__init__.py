"""The GPU check a borrowed GPU machine runs (`run.sh`), and its CPU dry run."""
