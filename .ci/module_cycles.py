#!/usr/bin/env python3
"""Fails when modules of the crate import each other in a circle (DESIGN.md: each layer
depends only on those below it). Reads `use` paths and `crate::` paths in src/ (comments and
unit-test modules left out); a module and its own submodules count as one (a type split over
files). Prints every circle with the imports that make it."""
import re, os, sys, itertools
root='src'
# module path of each file
mods={}
for d,_,fs in os.walk(root):
    for f in fs:
        if not f.endswith('.rs'): continue
        p=os.path.join(d,f)
        rel=os.path.relpath(p,root)[:-3].split('/')
        if rel[-1]=='mod': rel=rel[:-1]
        if rel==['lib']: rel=[]
        mods['::'.join(rel)]=p
def resolve(cur, path):
    parts=path.split('::')
    if parts[0]=='crate': parts=parts[1:]; base=[]
    elif parts[0] in ('super','self'):
        base=cur.split('::') if cur else []
        # file-level module: self = cur
        while parts and parts[0] in ('super','self'):
            if parts[0]=='super': base=base[:-1]
            parts=parts[1:]
    else: return None
    full=base+parts
    # longest prefix that is a module
    for k in range(len(full),-1,-1):
        m='::'.join(full[:k])
        if m in mods: return m
    return None
edges=set()
for m,p in mods.items():
    src=open(p).read()
    src=re.sub(r'//[^\n]*','',src)
    # drop cfg(test) modules crudely: cut from '#[cfg(test)]\nmod tests' to end
    i=src.find('#[cfg(test)]\nmod tests')
    if i>=0: src=src[:i]
    for u in re.findall(r'\buse\s+([^;]+);',src):
        u=u.replace('\n',' ')
        head=u.split('{')[0].strip().rstrip(':')
        items=[head]
        if '{' in u:
            inner=u[u.index('{')+1:u.rindex('}')]
            for it in re.split(r',(?![^{]*\})',inner):
                it=it.strip().split(' as ')[0].split('{')[0].strip().rstrip(':')
                if it and it!='self': items.append(head+'::'+it)
        for it in items:
            t=resolve(m,it)
            if t is not None and t!=m: edges.add((m,t))
    for u in re.findall(r'\b(crate::[a-z_]+(?:::[a-z_]+)*)',src):
        t=resolve(m,u)
        if t is not None and t!=m: edges.add((m,t))
# collapse: compare at the granularity where parent-child edges are ignored
def anc(a,b): return b=='' or a==b or a.startswith(b+'::')
g={}
for a,b in edges:
    if anc(a,b) or anc(b,a): continue  # parent/child
    g.setdefault(a,set()).add(b)
# find cycles via Tarjan
idx={};low={};st=[];on=set();out=[];c=[0]
def sc(v):
    idx[v]=low[v]=c[0];c[0]+=1;st.append(v);on.add(v)
    for w in g.get(v,()):
        if w not in idx: sc(w);low[v]=min(low[v],low[w])
        elif w in on: low[v]=min(low[v],idx[w])
    if low[v]==idx[v]:
        comp=[]
        while True:
            w=st.pop();on.discard(w);comp.append(w)
            if w==v:break
        if len(comp)>1: out.append(comp)
sys.setrecursionlimit(10000)
for v in list(g): 
    if v not in idx: sc(v)
for comp in out:
    print("CYCLE:", comp)
    for a,b in edges:
        if a in comp and b in comp and not (anc(a,b) or anc(b,a)): print("   ",a,'->',b)
print(f"module imports: {len(mods)} modules, {len(edges)} imports, {len(out)} circles")
sys.exit(1 if out else 0)
