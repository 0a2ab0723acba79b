def write_pages(src, out):
    pass
