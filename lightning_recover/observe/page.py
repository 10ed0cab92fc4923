"""The status page: one HTML document, no external asset (it works offline and behind any proxy).

The job's state is embedded in the page when it is served, and an inline script draws it at once (so a
browser that loads the page shows the replicas without a second request), then asks ``/status`` again
every second and redraws: the table of replicas, the timeline of events with the generations, the
throughput over time.
"""

from __future__ import annotations

import html
import json
from typing import Any

_STYLE = """
body{font:14px system-ui,sans-serif;margin:16px;color:#222;background:#fafafa}
h1{font-size:18px;margin:0 0 8px}
.summary span{display:inline-block;margin-right:18px}
.summary b{font-size:16px}
table{border-collapse:collapse;margin:10px 0;background:#fff}
th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#eee}
td.state-live{color:#176f2c;font-weight:bold}
td.state-dead,td.state-exited{color:#a61b1b;font-weight:bold}
td.state-joining{color:#9a6a00;font-weight:bold}
#stale{display:none;color:#fff;background:#a61b1b;padding:4px 8px;margin:6px 0}
ol#events{font-family:monospace;font-size:12px;max-height:260px;overflow:auto;background:#fff;border:1px solid #ccc;padding:4px 4px 4px 40px}
.ev-death,.ev-exit{color:#a61b1b}.ev-recovery{color:#176f2c}.ev-join,.ev-start{color:#1b4fa6}.ev-leave{color:#8a5a00}
svg{background:#fff;border:1px solid #ccc}
"""

_SCRIPT = r"""
const COLORS={death:'#a61b1b',exit:'#a61b1b',recovery:'#176f2c',join:'#1b4fa6',start:'#1b4fa6',leave:'#8a5a00',checkpoint:'#777',monitor:'#444'};
function el(tag,attrs,text){const e=document.createElement(tag);for(const k in attrs||{})e.setAttribute(k,attrs[k]);if(text!==undefined)e.textContent=text;return e;}
function fmt(x,d){return (x===null||x===undefined)?'-':Number(x).toFixed(d);}
function clock(t){return new Date(t*1000).toLocaleTimeString();}
function svgEl(tag,attrs){const e=document.createElementNS('http://www.w3.org/2000/svg',tag);for(const k in attrs)e.setAttribute(k,attrs[k]);return e;}
function summary(s){
  const rec=Object.entries(s.recoveries).map(([c,n])=>c+' '+n).join(', ');
  const parts=[['live replicas',s.live_replicas+' / '+s.replicas],['generation',s.generation],['committed step',s.committed_step],
    ['microbatches/s',fmt(s.microbatches_per_second,1)],['recoveries',rec],['control plane',s.control_plane]];
  const box=document.getElementById('summary');box.replaceChildren();
  for(const [k,v] of parts){const sp=el('span',{'data-name':k});sp.append(k+': ');sp.append(el('b',{},String(v)));box.append(sp);}
}
function table(s){
  const body=document.querySelector('#replicas tbody');body.replaceChildren();
  for(const r of s.table){
    const tr=el('tr',{'data-replica':r.replica});
    const cells=[r.replica,r.host||'-',r.incarnation,r.state,r.generation<0?'-':r.generation,r.step<0?'-':r.step,r.quota,r.phase||'-',fmt(r.heartbeat_age,2)];
    cells.forEach((c,i)=>{const td=el('td',{},String(c));if(i===3)td.className='state-'+String(c).split(' ')[0];tr.append(td);});
    body.append(tr);
  }
}
function events(s){
  const ol=document.getElementById('events');ol.replaceChildren();
  for(const e of s.events.slice(-40).reverse()){ol.append(el('li',{class:'ev-'+e.kind},clock(e.time)+'  g'+e.generation+'  '+e.kind+'  '+(e.what||'')));}
}
function timeline(s){
  const svg=document.getElementById('timeline');svg.replaceChildren();
  const W=900,H=70,t0=s.started,t1=Math.max(s.time,t0+1),x=t=>10+(W-20)*(t-t0)/(t1-t0);
  let gen=null,from=t0,shade=0;
  const band=(a,b,g)=>{svg.append(svgEl('rect',{x:x(a),y:8,width:Math.max(1,x(b)-x(a)),height:22,fill:shade++%2?'#dde7f5':'#eef3fa'}));
    const t=svgEl('text',{x:x(a)+3,y:24,'font-size':11});t.textContent='g'+g;svg.append(t);};
  for(const e of s.events){if(e.generation!==gen){if(gen!==null)band(from,e.time,gen);gen=e.generation;from=e.time;}}
  if(gen!==null)band(from,t1,gen);
  for(const e of s.events){svg.append(svgEl('circle',{cx:x(e.time),cy:48,r:5,fill:COLORS[e.kind]||'#000','data-kind':e.kind}));}
  const l=svgEl('text',{x:10,y:66,'font-size':10});l.textContent=clock(t0)+' .. '+clock(t1);svg.append(l);
}
function throughput(s){
  const svg=document.getElementById('throughput');svg.replaceChildren();
  const pts=s.throughput;if(pts.length<2)return;
  const W=900,H=120,t0=pts[0][0],t1=pts[pts.length-1][0],top=Math.max(...pts.map(p=>p[1]),1e-9);
  const d=pts.map(p=>(10+(W-20)*(p[0]-t0)/Math.max(t1-t0,1e-9)).toFixed(1)+','+(H-10-(H-30)*p[1]/top).toFixed(1)).join(' ');
  svg.append(svgEl('polyline',{points:d,fill:'none',stroke:'#1b4fa6','stroke-width':2}));
  const t=svgEl('text',{x:10,y:14,'font-size':11});t.textContent='max '+top.toFixed(1)+' microbatches/s';svg.append(t);
}
function draw(s){summary(s);table(s);events(s);timeline(s);throughput(s);document.getElementById('updated').textContent=clock(s.time);}
draw(JSON.parse(document.getElementById('initial').textContent));
async function refresh(){
  try{const r=await fetch('status',{cache:'no-store'});if(!r.ok)throw new Error(r.status);draw(await r.json());document.getElementById('stale').style.display='none';}
  catch(err){const b=document.getElementById('stale');b.textContent='the monitor does not answer ('+err+'): the page shows its last answer';b.style.display='block';}
}
setInterval(refresh,1000);
"""


def render_page(status: dict[str, Any], title: str = "lightning-recover") -> bytes:
    """The page for ``status`` (the ``/status`` JSON), drawn by its inline script."""
    # Inside <script>, "</" would end the element: JSON never needs it unescaped.
    embedded = json.dumps(status).replace("</", "<\\/")
    head = ["replica", "host", "incarnation", "state", "generation", "step", "quota", "phase", "heartbeat age (s)"]
    doc = f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>{html.escape(title)}</title>
<meta name="viewport" content="width=device-width, initial-scale=1"><style>{_STYLE}</style></head>
<body>
<h1>{html.escape(title)} <small>updated <span id="updated"></span></small></h1>
<div id="stale"></div>
<div class="summary" id="summary"></div>
<table id="replicas"><thead><tr>{"".join(f"<th>{h}</th>" for h in head)}</tr></thead><tbody></tbody></table>
<h2>Timeline (generations and events)</h2>
<svg id="timeline" width="900" height="70" role="img" aria-label="timeline"></svg>
<h2>Throughput</h2>
<svg id="throughput" width="900" height="120" role="img" aria-label="throughput"></svg>
<h2>Events</h2>
<ol id="events" reversed></ol>
<noscript>This page draws itself with a script; <a href="status">status</a> is the same as JSON.</noscript>
<script type="application/json" id="initial">{embedded}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
    return doc.encode()
