"""Pictures of a pipeline: the partition diagram (DOT, Graphviz or matplotlib) and Gantt
charts of timelines. They read a Partitioned or a Timeline and import no executor;
matplotlib and graphviz load only when a picture is asked for."""
