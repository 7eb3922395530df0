"""What a pipeline shows of itself: timelines (predicted and measured), what each stage
holds in the model's names, the summary's numbers as people read them, the memory report,
the partition diagram (DOT, Graphviz or matplotlib), Gantt charts and the HTML page. These
modules read a Partitioned or a Timeline and import no runtime; matplotlib and graphviz load
only when a picture is asked for."""
